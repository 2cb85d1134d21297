"""The experts' gradient: each backend's own ``experts_backward`` against an fp64
formula and the reference backend, and which backend's gradient runs.

Legend: T tokens, H hidden size, I expert intermediate size, F = 2*I, E experts,
K experts per token, R rows.

The grouped_mm backend's gradient runs here under the Triton interpreter
(the `triton` marker), its GEMMs through torch._grouped_mm's CPU kernels; the
GPU tests at real model widths are in tests/test_backends.py.
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch

import formulas
from torch_moe_ops.backends.common.kernels import grouped_backward
from torch_moe_ops.backends.common.kernels.activation import activation, activation_backward
from torch_moe_ops.backends.registry import ExpertsBackend, Registry
from torch_moe_ops.config import ACTIVATIONS
from torch_moe_ops.ops import define_backend_ops
from torch_moe_ops.ops.library import defines

GRAD_NAMES = ("hidden", "topk_weights", "w13", "w2", "b13", "b2")
# Swiglu's clamps cut in at 0.5: both sides of them are exercised.
STATIC = {"silu": ("silu", 1.702, 7.0), "gelu": ("gelu", 1.702, 7.0),
          "swiglu_oai": ("swiglu_oai", 1.702, 0.5)}
CASES = {  # name: make_expert_inputs arguments
    "bias_skips": dict(bias=True, skip_fraction=0.3),
    "no_bias": dict(skip_fraction=0.3),
    "top_k_1": dict(top_k=1, bias=True),
    "no_tokens": dict(num_tokens=0, bias=True),
    "all_skipped": dict(skip_fraction=1.0, bias=True),
    "poisoned_unchosen_expert": dict(bias=True, skip_fraction=0.3),
}
SIZES = dict(num_tokens=7, hidden_size=16, intermediate_size=8, num_experts=5, top_k=2)
# (namespace, dtypes): the backends with a gradient of their own that run here.
OWN_BACKWARDS = [
    pytest.param("moe_reference", (torch.float32, torch.bfloat16), id="reference"),
    pytest.param("moe_cpu", (torch.float32, torch.bfloat16, torch.float16), id="cpu"),
    # The interpreter mishandles bf16 (see test_backends.py).
    pytest.param("moe_grouped_mm", (torch.float32, torch.float16), id="grouped_mm",
                 marks=pytest.mark.triton),
]
FORWARD_ONLY_NAMESPACE = "moe_test_forward_only"


def case_inputs(expert_inputs, case: str, dtype: torch.dtype):
    """The inputs of ``case``; "poisoned_unchosen_expert" leaves the last expert
    unchosen with NaN weights and gives the skipped slots NaN routing weights."""
    inputs = expert_inputs(**{**SIZES, **CASES[case]}, dtype=dtype)
    if case == "poisoned_unchosen_expert":
        last = SIZES["num_experts"] - 1
        inputs.topk_ids_TK = torch.where(inputs.topk_ids_TK == last, -1, inputs.topk_ids_TK)
        inputs.topk_weights_TK[inputs.topk_ids_TK < 0] = math.nan
        for name in ("w13_EFH", "w2_EHI", "b13_EF", "b2_EH"):
            getattr(inputs, name)[last] = math.nan
    return inputs


def static_args(act: str, inputs) -> tuple:
    """``(activation, alpha, limit)``; for swiglu_oai a limit that the chosen
    experts' pre-activations cross but none lies within 0.01 of: rounded to
    fp16/bf16 it could land on the other side of the clamp, whose gradient jumps there."""
    if act != "swiglu_oai":
        return STATIC[act]
    ids_S = inputs.topk_ids_TK.reshape(-1).long()
    tokens_S = torch.arange(ids_S.numel()) // inputs.topk_ids_TK.shape[1]
    chosen_S = ids_S >= 0
    ids_S, tokens_S = ids_S[chosen_S], tokens_S[chosen_S]
    h_SF = torch.einsum("sh,sfh->sf", inputs.hidden_TH.double()[tokens_S],
                        inputs.w13_EFH.double()[ids_S])
    if inputs.b13_EF is not None:
        h_SF = h_SF + inputs.b13_EF.double()[ids_S]
    magnitudes = h_SF.abs().flatten()
    for limit in (0.3 + 0.01 * step for step in range(170)):
        if not ((magnitudes - limit).abs() < 0.01).any():
            return act, 1.702, limit
    raise AssertionError("no swiglu limit keeps 0.01 off every pre-activation")


def assert_grads_close(grads, expected, dtype, check) -> None:
    for name, grad, want in zip(GRAD_NAMES, grads, expected):
        if want is None:
            assert grad.shape == (0,), name
            continue
        assert grad.shape == want.shape and grad.is_contiguous(), name
        # An unchosen expert's NaN weights get exactly zero gradient.
        check(grad.nan_to_num(nan=1e6), want.nan_to_num(nan=1e6), dtype)


@pytest.mark.parametrize("namespace,dtypes", OWN_BACKWARDS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_backward_matches_the_fp64_formula(namespace, dtypes, case, act, expert_inputs,
                                           generator, assert_grad_close_for_dtype,
                                           poisoned_empty):
    # Every buffer a backend allocates starts as NaN: a row of skipped slots
    # the gradient reads after all shows up.
    for dtype in dtypes:
        inputs = case_inputs(expert_inputs, case, dtype)
        grad_out_TH = torch.randn(inputs.hidden_TH.shape, generator=generator).to(dtype)
        args = (grad_out_TH, *inputs.args(*static_args(act, inputs)))
        grads = getattr(torch.ops, namespace).experts_backward(*args)
        expected = formulas.experts_backward_formula(*args)
        assert [g.dtype for g in grads] == [dtype, torch.float32, dtype, dtype, dtype, dtype]
        assert_grads_close(grads, expected, dtype, assert_grad_close_for_dtype)


@pytest.mark.parametrize("namespace", ["moe_cpu", pytest.param("moe_grouped_mm",
                                                                marks=pytest.mark.triton)])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_backward_matches_the_reference_in_fp32(namespace, act, expert_inputs, generator):
    inputs = case_inputs(expert_inputs, "poisoned_unchosen_expert", torch.float32)
    grad_out_TH = torch.randn(inputs.hidden_TH.shape, generator=generator)
    args = (grad_out_TH, *inputs.args(*STATIC[act]))
    grads = getattr(torch.ops, namespace).experts_backward(*args)
    for name, grad, want in zip(GRAD_NAMES, grads, torch.ops.moe_reference.experts_backward(*args)):
        torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-5, msg=name)
    assert all((grad[-1] == 0).all() for grad in grads[2:])


def rows_leaves(generator, expert_inputs) -> tuple:
    """``experts_rows`` inputs that require grad: rows of expert -1 between the
    others, holding NaN (uninitialised capacity), and an expert without rows."""
    inputs = expert_inputs(**{**SIZES, "bias": True})
    x_RH = torch.randn((6, SIZES["hidden_size"]), generator=generator)
    x_RH[[1, 4]] = math.nan
    expert_R = torch.tensor([0, -1, 2, 3, -1, 0], dtype=torch.int32)
    count_E = torch.tensor([2, 0, 1, 1, 0], dtype=torch.int32)
    leaves = [t.clone().requires_grad_(True)
              for t in (x_RH, inputs.w13_EFH, inputs.w2_EHI, inputs.b13_EF, inputs.b2_EH)]
    return leaves[0], expert_R, count_E, *leaves[1:]


@pytest.mark.parametrize("namespace", ["moe_cpu", pytest.param("moe_grouped_mm",
                                                                marks=pytest.mark.triton)])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_experts_rows_gradient_matches_the_reference(namespace, act, generator, expert_inputs):
    args = rows_leaves(generator, expert_inputs)
    grad_y_RH = torch.randn((6, SIZES["hidden_size"]), generator=generator)
    floats = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    got = torch.autograd.grad(getattr(torch.ops, namespace).experts_rows(*args, *STATIC[act]),
                              floats, grad_y_RH)
    want = torch.autograd.grad(torch.ops.moe_reference.experts_rows(*args, *STATIC[act]),
                               floats, grad_y_RH)
    for name, grad, expected in zip(("x_rows", "w13", "w2", "b13", "b2"), got, want):
        assert grad.isfinite().all(), name
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5, msg=name)
    assert (got[0][[1, 4]] == 0).all() and all((grad[1] == 0).all() for grad in got[1:])


def test_cpu_backward_is_deterministic(expert_inputs, generator):
    inputs = expert_inputs(num_tokens=64, hidden_size=32, intermediate_size=16, num_experts=4,
                           top_k=3, bias=True, skip_fraction=0.2)
    grad_out_TH = torch.randn(inputs.hidden_TH.shape, generator=generator)
    first, second = (torch.ops.moe_cpu.experts_backward(grad_out_TH, *inputs.args())
                     for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_activation_backward_matches_autograd(act, generator):
    _, alpha, limit = STATIC[act]
    gate_NI, up_NI = (torch.randn((64, 8), generator=generator, dtype=torch.float64) * 1.5
                      for _ in range(2))
    # Keep finite differences of autograd off the clamps' kinks.
    gate_NI = torch.where((gate_NI - limit).abs() < 1e-3, gate_NI + 0.01, gate_NI)
    grad_NI = torch.randn((64, 8), generator=generator, dtype=torch.float64)
    leaves = (gate_NI.requires_grad_(True), up_NI.requires_grad_(True))
    expected = torch.autograd.grad(activation(*leaves, act, alpha, limit), leaves, grad_NI)
    got = activation_backward(grad_NI, gate_NI.detach(), up_NI.detach(), act, alpha, limit)
    for grad, want in zip(got, expected):
        torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-12)


@pytest.mark.triton
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True])
def test_triton_steps_match_the_torch_steps(act, bias, generator):
    from torch_moe_ops.backends.common.kernels import epilogues
    from torch_moe_ops.backends.common.kernels.grouped_gemm import TRITON_STEPS

    num_rows, inter_size, num_experts = 9, 24, 3
    expert_R = torch.tensor([0, 0, 1, 1, 1, 2, 2, -1, -1], dtype=torch.int32)
    h_RF = torch.randn((num_rows, 2 * inter_size), generator=generator) * 2
    b13_EF = torch.randn((num_experts, 2 * inter_size), generator=generator) if bias else None
    gw2_RI = torch.randn((num_rows, inter_size), generator=generator)
    weight_R = torch.rand(num_rows, generator=generator)
    args = (h_RF, b13_EF, expert_R, gw2_RI, weight_R, *STATIC[act])
    kept = expert_R >= 0  # rows of expert -1 are undefined
    for got, want in zip(TRITON_STEPS.act_backward_rows(*args),
                         grouped_backward.TORCH_STEPS.act_backward_rows(*args)):
        torch.testing.assert_close(got[kept], want[kept], rtol=1e-5, atol=1e-5)

    count_E = torch.tensor([2, 0, 3], dtype=torch.int32)
    # 5000: two blocks of an expert; the second size one block more than an expert's
    # programs, so that a program loops.
    looped = (epilogues.ZERO_PROGRAMS // num_experts + 1) * epilogues.BLOCK_ZERO + 7
    for numel in (5000, looped):
        for steps in (TRITON_STEPS, grouped_backward.TORCH_STEPS):
            grad_EX = torch.full((num_experts, numel), math.nan)
            steps.zero_empty_experts_(grad_EX, count_E)
            assert (grad_EX[1] == 0).all() and grad_EX[[0, 2]].isnan().all()

    row_of_slot_S = torch.randperm(8, generator=generator).to(torch.int32)
    ids_TK = torch.tensor([[0, -1], [1, 2], [-1, -1], [2, 0]], dtype=torch.int32)
    values_RH = torch.randn((8, 6), generator=generator)
    torch.testing.assert_close(
        TRITON_STEPS.sum_token_rows(values_RH, row_of_slot_S, ids_TK),
        grouped_backward.TORCH_STEPS.sum_token_rows(values_RH, row_of_slot_S, ids_TK))

    # Rows of expert -1 are never written (most of a rank's rows under expert parallelism):
    # the rest gathered, converted, from a strided input; 2500 columns: 3 blocks.
    order_R = torch.randperm(9, generator=generator)
    values_TH = torch.randn((2500, 3), generator=generator).t()  # T = 3 of top-k 3
    for dtype in (None, torch.float64):
        got = TRITON_STEPS.routed_rows(values_TH, order_R, expert_R, 3, dtype)
        want = grouped_backward.TORCH_STEPS.routed_rows(values_TH, order_R, expert_R, 3, dtype)
        assert got.dtype == want.dtype == (dtype or torch.float32)
        torch.testing.assert_close(got[kept], want[kept], rtol=0, atol=0)


@pytest.mark.triton
@pytest.mark.parametrize("case", ["bias_skips", "no_tokens"])
def test_opcheck_grouped_mm_experts_backward(case, expert_inputs, generator):
    # tests/test_opcheck.py covers every backend's op at sizes grouped_mm rejects.
    inputs = case_inputs(expert_inputs, case, torch.float32)
    grad_out_TH = torch.randn(inputs.hidden_TH.shape, generator=generator)
    torch.library.opcheck(torch.ops.moe_grouped_mm.experts_backward.default,
                          (grad_out_TH, *inputs.args(*STATIC["swiglu_oai"])))


def ops_run(run) -> list[str]:
    """The MoE ops ``run()`` calls, nested calls included, in order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run()
    return [event.name for event in profile.events() if event.name.startswith("moe")]


def backward_ops(op, expert_inputs, dtype=torch.float32, rows=False, device="cpu") -> list[str]:
    """The MoE ops that ``loss.backward()`` runs after ``op`` (an experts op) ran forward."""
    inputs = expert_inputs(**{**SIZES, "bias": True, "skip_fraction": 0.2}, dtype=dtype)
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in inputs.args())
    if rows:
        x_RH, expert_R, _, _, count_E, _ = torch.ops.moe.dispatch(*args[:3], SIZES["num_experts"])
        args = (x_RH, expert_R, count_E, *args[3:])
    args = tuple(a.requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point()
                 else a for a in args)
    loss = op(*args).square().sum()
    return ops_run(loss.backward)


BACKENDS_ON_CPU = [  # namespace, the experts_backward ops its gradient runs, in order
    ("moe_reference", ["moe_reference::experts_backward"]),
    ("moe_cpu", ["moe_cpu::experts_backward"]),
    pytest.param("moe_grouped_mm", ["moe_grouped_mm::experts_backward"],
                 marks=pytest.mark.triton),
    # grouped_gemm.supports does not hold on the CPU: triton hands its gradient over.
    pytest.param("moe_triton", ["moe_triton::experts_backward", "moe_reference::experts_backward"],
                 marks=pytest.mark.triton),
]


@pytest.mark.parametrize("namespace,expected", BACKENDS_ON_CPU)
@pytest.mark.parametrize("op_name", ["experts", "experts_rows"])
def test_backward_runs_where_the_forward_ran(namespace, expected, op_name, expert_inputs):
    op = getattr(getattr(torch.ops, namespace), op_name)
    ran = backward_ops(op, expert_inputs, rows=op_name == "experts_rows")
    assert [name for name in ran if name.endswith("::experts_backward")] == expected


@pytest.mark.gpu
@pytest.mark.parametrize("namespace", ["moe_triton", "moe_grouped_mm"])
@pytest.mark.parametrize("op_name", ["experts", "experts_rows"])
def test_gpu_backward_runs_where_the_forward_ran(namespace, op_name, expert_inputs):
    # bf16 on sm90+: both hand nothing to the reference.
    op = getattr(getattr(torch.ops, namespace), op_name)
    ran = backward_ops(op, expert_inputs, torch.bfloat16, op_name == "experts_rows", "cuda")
    assert [name for name in ran if name.endswith("::experts_backward")] == [
        f"{namespace}::experts_backward"]


def test_generic_op_backward_runs_on_the_default_backend(expert_inputs):
    ran = backward_ops(torch.ops.moe.experts, expert_inputs)
    assert [name for name in ran if name.endswith("::experts_backward")] == [
        "moe::experts_backward", "moe_cpu::experts_backward"]


def test_cpu_hands_fp64_to_the_reference(expert_inputs):
    ran = backward_ops(torch.ops.moe_cpu.experts, expert_inputs, dtype=torch.float64)
    assert [name for name in ran if name.endswith("::experts_backward")] == [
        "moe_cpu::experts_backward", "moe_reference::experts_backward"]


@pytest.fixture(scope="module")
def forward_only_backend() -> ExpertsBackend:
    """A backend that defines the experts ops and no gradient of its own."""
    if not defines(FORWARD_ONLY_NAMESPACE, "experts"):
        define_backend_ops(FORWARD_ONLY_NAMESPACE, {
            "experts": lambda *args: torch.ops.moe_reference.experts(*args),
            "experts_rows": lambda *args: torch.ops.moe_reference.experts_rows(*args)})
    return ExpertsBackend(name="forward_only", namespace=FORWARD_ONLY_NAMESPACE,
                          supports=lambda *_: None, priority=0, description="test")


@pytest.mark.parametrize("op_name", ["experts", "experts_rows"])
def test_backend_without_its_own_backward_uses_the_reference(op_name, forward_only_backend,
                                                             expert_inputs):
    op = getattr(getattr(torch.ops, FORWARD_ONLY_NAMESPACE), op_name)
    ran = backward_ops(op, expert_inputs, rows=op_name == "experts_rows")
    assert [name for name in ran if name.endswith("::experts_backward")] == [
        "moe_reference::experts_backward"]


def test_registry_says_where_the_backward_runs(forward_only_backend):
    registry = Registry()
    registry.register_experts(forward_only_backend)
    row, = registry.status(torch.device("cpu"), torch.float32)
    assert row.backward == "reference"
    assert "backward" in str(registry.status(torch.device("cpu"), torch.float32)).splitlines()[0]
    with pytest.raises(ValueError, match="backward must be given exactly when "
                                         "moe_test_forward_only::experts_backward is defined"):
        registry.register_experts(ExpertsBackend(
            name="claims_a_backward", namespace=FORWARD_ONLY_NAMESPACE,
            supports=lambda *_: None, priority=0, description="test",
            backward=lambda *_: None))


# Double backward: no backend computes a gradient of a gradient; asking for one
# raises, naming the backward op, instead of torch's deprecated autograd
# fallback (which warns and gives a wrong second gradient).
FALLBACK_WARNING = r".*autograd kernel was not registered"


def double_backward_refused(op: str) -> str:
    return f"^{re.escape(op)} has no gradient: double backward"


def leaves_of(args) -> list[torch.Tensor]:
    return [a.requires_grad_(True) for a in args
            if isinstance(a, torch.Tensor) and a.is_floating_point()]


@pytest.mark.parametrize("namespace", ["moe", "moe_reference", "moe_cpu"])
def test_double_backward_raises_naming_the_op(namespace, expert_inputs):
    op = getattr(torch.ops, namespace).experts
    args = expert_inputs(**{**SIZES, "bias": True, "skip_fraction": 0.2}).args()
    leaves = leaves_of(args)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=FALLBACK_WARNING)
        op(*args).square().sum().backward()
        grads = torch.autograd.grad(op(*args).square().sum(), leaves, create_graph=True)
        with pytest.raises(RuntimeError,
                           match=double_backward_refused(f"{namespace}::experts_backward")):
            sum(grad.square().sum() for grad in grads).backward()


@pytest.mark.parametrize("through", ["dispatch", "combine"])
def test_double_backward_through_dispatch_or_combine_raises(through, expert_inputs):
    inputs = expert_inputs(**{**SIZES, "skip_fraction": 0.2})
    hidden_TH, weights_TK = leaves_of((inputs.hidden_TH, inputs.topk_weights_TK))
    x_RH, _, weight_R, src_R, _, combine_map_TK = torch.ops.moe.dispatch(
        hidden_TH, weights_TK, inputs.topk_ids_TK, SIZES["num_experts"])
    y_RH = x_RH.square()
    out_TH = torch.ops.moe.combine(y_RH, weight_R, src_R, combine_map_TK)
    wrt = hidden_TH if through == "dispatch" else y_RH
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=FALLBACK_WARNING)
        grad, = torch.autograd.grad(out_TH.square().sum(), wrt, create_graph=True)
        with pytest.raises(RuntimeError,
                           match=double_backward_refused(f"moe::{through}_backward")):
            grad.square().sum().backward()
