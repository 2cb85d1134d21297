"""The ``cpu`` experts backend against the reference backend, and what makes it sparse.

Legend: T tokens, H hidden size, I expert intermediate size, E experts,
K experts per token, R rows.
"""

from __future__ import annotations

import math

import pytest
import torch

import torch_moe_ops as tmo
from graph_tests.aot_graphs import AotGraphs
from torch_moe_ops.backends import cpu
from torch_moe_ops.backends.common.kernels.tracing import for_inductor
from torch_moe_ops.backends.registry import REGISTRY, Problem
from torch_moe_ops.config import BackendSpec

ACTIVATIONS = ("silu", "gelu", "swiglu_oai")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# The reference rounds once, at the output; this backend also rounds each GEMM's
# output to the input dtype (as the GPU kernels do): a few roundings of the dtype,
# relative to the output's scale.
BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float64: 1e-10}
# GROUPED_MM_MIN_ACTIVE_FRACTION per path: torch._grouped_mm where it runs, or the loop.
PATHS = {"grouped_mm": 0.0, "loop": math.inf}
STATIC = ("silu", 1.702, 7.0)


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    scale = max(1.0, ref.double().abs().max().item()) if ref.numel() else 1.0
    bound = BOUNDS[ref.dtype] * scale
    torch.testing.assert_close(out.double(), ref.double(), rtol=bound, atol=bound)


def rows_of(inputs) -> tuple:
    """The rows format of ``inputs`` (dispatch's), with the expert weights."""
    x_RH, expert_R, _, _, count_E, _ = torch.ops.moe.dispatch(
        inputs.hidden_TH, inputs.topk_weights_TK, inputs.topk_ids_TK, inputs.w13_EFH.shape[0])
    return (x_RH, expert_R, count_E, inputs.w13_EFH, inputs.w2_EHI, inputs.b13_EF,
            inputs.b2_EH)


@pytest.fixture(params=sorted(PATHS))
def path(request, monkeypatch):
    monkeypatch.setattr(cpu, "GROUPED_MM_MIN_ACTIVE_FRACTION", PATHS[request.param])
    return request.param


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [0, 1, 7])
@pytest.mark.parametrize("rows", [False, True])
def test_matches_reference(expert_inputs, path, act, bias, dtype, num_tokens, rows):
    inputs = expert_inputs(num_tokens=num_tokens, hidden_size=32,
                                intermediate_size=16, num_experts=6, top_k=2, dtype=dtype,
                                bias=bias, skip_fraction=0.3)
    static = (act, 1.702, 7.0)
    if rows:
        args = rows_of(inputs)
        out = torch.ops.moe_cpu.experts_rows(*args, *static)
        ref = torch.ops.moe_reference.experts_rows(*args, *static)
    else:
        out = torch.ops.moe_cpu.experts(*inputs.args(*static))
        ref = torch.ops.moe_reference.experts(*inputs.args(*static))
    assert_matches(out, ref)


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gathered_body_matches_reference(expert_inputs, act, bias, dtype):
    inputs = expert_inputs(num_tokens=5, hidden_size=32, intermediate_size=16,
                                num_experts=6, top_k=2, dtype=dtype, bias=bias,
                                skip_fraction=0.3)
    static = (act, 1.702, 7.0)
    assert_matches(cpu.gathered_experts(*inputs.args(*static)),
                   torch.ops.moe_reference.experts(*inputs.args(*static)))


def poison_experts(inputs, experts: list[int]) -> None:
    """NaN in every weight and bias of ``experts``: must never reach the output."""
    for t in (inputs.w13_EFH, inputs.w2_EHI, inputs.b13_EF, inputs.b2_EH):
        t[experts] = math.nan


@pytest.mark.parametrize("rows", [False, True])
def test_unchosen_and_skipped_do_not_leak(expert_inputs, path, rows):
    inputs = expert_inputs(num_tokens=6, hidden_size=32, intermediate_size=16,
                                num_experts=6, top_k=2, bias=True)
    # Experts 0 and 5 chosen by no slot, one slot skipped with a NaN weight.
    inputs.topk_ids_TK.copy_(torch.tensor([[1, 2], [3, 4], [2, 1], [4, 3], [1, 3], [2, -1]]))
    inputs.topk_weights_TK[5, 1] = math.nan
    clean = (torch.ops.moe_cpu.experts_rows(*rows_of(inputs), *STATIC) if rows
             else torch.ops.moe_cpu.experts(*inputs.args()))
    poison_experts(inputs, [0, 5])
    out = (torch.ops.moe_cpu.experts_rows(*rows_of(inputs), *STATIC) if rows
           else torch.ops.moe_cpu.experts(*inputs.args()))
    assert out.isfinite().all()
    torch.testing.assert_close(out, clean, rtol=0, atol=0)


def test_gathered_body_drops_skipped_slots_reading_a_poisoned_expert(expert_inputs):
    # Skipped slots read expert 0 (static shapes): its NaN must be dropped, not multiplied.
    inputs = expert_inputs(num_tokens=4, hidden_size=32, intermediate_size=16,
                                num_experts=6, top_k=2, bias=True)
    inputs.topk_ids_TK.copy_(torch.tensor([[1, 2], [3, -1], [-1, 5], [4, 3]]))
    clean = torch.ops.moe_reference.experts(*inputs.args())
    poison_experts(inputs, [0])
    out = cpu.gathered_experts(*inputs.args())
    assert out.isfinite().all()
    assert_matches(out, clean)


class GemmRows:
    """Rows of every GEMM the backend runs (``torch._grouped_mm``, the loop's ``torch.mm``)."""

    def __init__(self, monkeypatch):
        self.grouped: list[int] = []
        self.looped: list[int] = []
        grouped_mm, mm = torch._grouped_mm, torch.mm
        monkeypatch.setattr(torch, "_grouped_mm", lambda x, *a, **k: self.grouped.append(
            x.shape[0]) or grouped_mm(x, *a, **k))
        monkeypatch.setattr(torch, "mm", lambda x, *a, **k: self.looped.append(
            x.shape[0]) or mm(x, *a, **k))


def test_skipped_slots_cost_no_gemm_rows(expert_inputs, path, monkeypatch):
    inputs = expert_inputs(num_tokens=5, hidden_size=32, intermediate_size=16,
                                num_experts=4, top_k=2)
    inputs.topk_ids_TK.view(-1)[[0, 3, 8]] = -1
    gemms = GemmRows(monkeypatch)
    torch.ops.moe_cpu.experts(*inputs.args())
    # Two projections over the 7 slots that have an expert.
    if path == "grouped_mm":
        assert gemms.grouped == [7, 7] and gemms.looped == []
    else:
        assert gemms.grouped == [] and sum(gemms.looped) == 2 * 7


def test_zero_tokens_and_all_skipped_run_no_gemm(expert_inputs, monkeypatch):
    gemms = GemmRows(monkeypatch)
    empty = expert_inputs(num_tokens=0, hidden_size=32, intermediate_size=16)
    assert torch.ops.moe_cpu.experts(*empty.args()).shape == (0, 32)
    skipped = expert_inputs(num_tokens=3, hidden_size=32, intermediate_size=16)
    skipped.topk_ids_TK.fill_(-1)
    out = torch.ops.moe_cpu.experts(*skipped.args())
    assert out.shape == (3, 32) and (out == 0).all()
    assert gemms.grouped == [] and gemms.looped == []


@pytest.mark.parametrize("num_tokens,hidden,dtype,grouped", [
    (64, 32, torch.float32, True),     # every expert has rows
    (1, 32, torch.float32, False),     # 2 of 16 experts have rows: loop over those two
    (64, 12, torch.float16, False),    # rows of 24 bytes: torch._grouped_mm cannot take them
    (64, 32, torch.float64, False),    # no float64 torch._grouped_mm on the CPU
])
def test_gemm_path_choice(expert_inputs, monkeypatch, num_tokens, hidden, dtype, grouped):
    inputs = expert_inputs(num_tokens=num_tokens, hidden_size=hidden,
                                intermediate_size=16, num_experts=16, top_k=2, dtype=dtype)
    gemms = GemmRows(monkeypatch)
    torch.ops.moe_cpu.experts(*inputs.args())
    assert bool(gemms.grouped) == grouped and bool(gemms.looped) != grouped


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("op", ["experts", "experts_rows"])
def test_opcheck(expert_inputs, bias, op):
    inputs = expert_inputs(num_tokens=5, hidden_size=32, intermediate_size=16,
                                num_experts=4, top_k=2, bias=bias, skip_fraction=0.3)
    args = inputs.args() if op == "experts" else (*rows_of(inputs), *STATIC)
    torch.library.opcheck(getattr(torch.ops.moe_cpu, op).default, args)


def test_backward_runs_on_reference(expert_inputs):
    inputs = expert_inputs(num_tokens=5, hidden_size=32, intermediate_size=16,
                                num_experts=4, top_k=2, bias=True, skip_fraction=0.3)
    grads = []
    for op in (torch.ops.moe_cpu.experts, torch.ops.moe_reference.experts):
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in
                  (inputs.hidden_TH, inputs.topk_weights_TK, inputs.topk_ids_TK,
                   inputs.w13_EFH, inputs.w2_EHI, inputs.b13_EF, inputs.b2_EH)]
        op(*leaves, *STATIC).square().sum().backward()
        grads.append([t.grad for t in leaves if t.requires_grad])
    for ours, ref in zip(*grads):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_auto_picks_cpu_on_the_cpu_and_not_elsewhere(dtype):
    assert REGISTRY.choose_experts(BackendSpec(), Problem(dtype), torch.device("cpu")).name == "cpu"
    reason = cpu.supports(BackendSpec(), Problem(dtype), torch.device("cuda"))
    assert reason == "runs on the CPU only (it reads row counts on the host, a sync on a GPU), " \
                     "got device cuda"
    assert "float32, bfloat16, float16 or float64, got torch.int32" in cpu.supports(
        BackendSpec(), Problem(torch.int32), torch.device("cpu"))


@pytest.mark.parametrize("dtype,backward", [(torch.float32, "own"), (torch.bfloat16, "own"),
                                            (torch.float64, "reference")], ids=str)
def test_listed_with_where_its_backward_runs(dtype, backward):
    row, = [s for s in REGISTRY.status(torch.device("cpu"), dtype) if s.name == "cpu"]
    assert row.available and row.backward == backward


def test_ids_out_of_range_raise(expert_inputs):
    inputs = expert_inputs(num_tokens=3, hidden_size=32, intermediate_size=16,
                                num_experts=4)
    inputs.topk_ids_TK[1, 0] = 4
    with pytest.raises(ValueError, match=r"topk_ids must hold -1 \(skip\) or expert ids in "
                                         r"\[0, 4\), got 4"):
        torch.ops.moe_cpu.experts(*inputs.args())


def small_moe(act: str = "swiglu_oai") -> tmo.MoE:
    cfg = tmo.MoEConfig(hidden_size=32, intermediate_size=16, num_experts=8, top_k=2,
                        scoring="softmax", renormalize=True, activation=act, expert_bias=True)
    torch.manual_seed(0)
    moe = tmo.MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=0.2)
    return moe


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiles_fullgraph_on_its_namespace():
    moe = small_moe()
    x_TH = torch.randn(6, 32)
    compiled = torch.compile(moe, fullgraph=True,
                             backend=tmo.backend(experts="cpu", inner="aot_eager"))
    with torch.no_grad():
        expected_TH = moe(x_TH)
        torch.testing.assert_close(compiled(x_TH), expected_TH, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("num_tokens,inductor,cached_bytes,traced", [
    (4, True, 0, True),             # 8 slots over 8 experts, for Inductor: traced in
    (4, False, 2**20, False),       # the same for another compiler: the op stays one node
    (5, True, 0, False),            # 10 slots over 8 experts, not in cache: one node
    (32, True, 2**20, True),        # 64 slots, 8 per expert, experts in cache: traced in
    (33, True, 2**20, False),       # 66 slots, more than 8 per expert: one node
])
def test_traced_into_the_graph_only_for_inductor_at_small_sizes(monkeypatch, num_tokens,
                                                                inductor, cached_bytes, traced):
    # The experts here take 48 KiB.
    monkeypatch.setattr(cpu, "GATHERED_CACHED_MAX_BYTES", cached_bytes)
    moe = small_moe()
    x_TH = torch.randn(num_tokens, 32)
    recorder = AotGraphs(BackendSpec(experts="cpu"))
    compiled = torch.compile(moe, fullgraph=True, backend=recorder)
    with torch.no_grad():
        expected_TH = moe(x_TH)
        if inductor:
            with for_inductor():
                out_TH = compiled(x_TH)
        else:
            out_TH = compiled(x_TH)
    torch.testing.assert_close(out_TH, expected_TH, rtol=1e-5, atol=1e-5)
    code, = recorder.codes
    assert ("moe_cpu.experts" not in code and "bmm" in code) == traced
    assert ("moe_cpu.experts" in code) != traced
