"""Shared fixtures of the CPU unit tests.

Legend: T tokens, H hidden size, I expert intermediate size, E experts,
K experts per token, F = 2*I (gate rows then up rows).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import torch_moe_ops  # noqa: F401  (registers the ops and their eager kernels)
from torch_moe_ops import quant
from torch_moe_ops.config import QuantSpec

# Per-dtype bounds on the error of an op against an fp64 formula evaluated on the
# same (rounded) inputs: the ops accumulate in fp32 and round the result once.
TOLERANCES = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
    torch.float16: {"rtol": 5e-3, "atol": 5e-3},
}
# Gradients go through two more matmuls than the forward: a looser fp32 bound.
GRAD_TOLERANCES = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    torch.bfloat16: {"rtol": 3e-2, "atol": 3e-2},
    torch.float16: {"rtol": 1e-2, "atol": 1e-2},
}
FLOAT_DTYPES = list(TOLERANCES)
# What `poisoned_empty` fills integer buffers with: no valid id, row or count.
INT_POISON = -777


def assert_close_within(table: dict, actual: torch.Tensor, expected: torch.Tensor,
                        dtype: torch.dtype) -> None:
    """``actual`` (any dtype) against an fp64 ``expected``; atol scales with the
    magnitude of ``expected`` so that one bound serves small and large outputs."""
    tol = table[dtype]
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol["rtol"],
                               atol=tol["atol"] * scale)


@pytest.fixture
def assert_close_for_dtype() -> Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]:
    """``check(actual, expected_fp64, dtype)`` under `TOLERANCES[dtype]`."""
    return lambda actual, expected, dtype: assert_close_within(TOLERANCES, actual, expected, dtype)


@pytest.fixture
def assert_grad_close_for_dtype() -> Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]:
    """``check(actual, expected_fp64, dtype)`` under `GRAD_TOLERANCES[dtype]`."""
    return lambda actual, expected, dtype: assert_close_within(GRAD_TOLERANCES, actual, expected,
                                                         dtype)


@pytest.fixture
def generator() -> torch.Generator:
    """A CPU generator with a fixed seed: every test draws the same numbers each run."""
    return torch.Generator().manual_seed(1234)


@dataclasses.dataclass
class ExpertInputs:
    """The tensor arguments of ``moe::experts`` (canonical layouts)."""

    hidden_TH: torch.Tensor
    topk_weights_TK: torch.Tensor
    topk_ids_TK: torch.Tensor
    w13_EFH: torch.Tensor
    w2_EHI: torch.Tensor
    b13_EF: torch.Tensor | None
    b2_EH: torch.Tensor | None

    def args(self, activation: str = "silu", swiglu_alpha: float = 1.702,
             swiglu_limit: float = 7.0) -> tuple:
        return (self.hidden_TH, self.topk_weights_TK, self.topk_ids_TK, self.w13_EFH,
                self.w2_EHI, self.b13_EF, self.b2_EH, activation, swiglu_alpha, swiglu_limit)


def random_topk_ids(num_tokens: int, num_experts: int, top_k: int,
                    generator: torch.Generator, dtype: torch.dtype = torch.int32,
                    skip_fraction: float = 0.0) -> torch.Tensor:
    """``[T, K]`` ids, distinct within a token; about ``skip_fraction`` of them -1."""
    ids_TK = torch.empty((0, top_k), dtype=torch.long)
    if num_tokens:
        ids_TK = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k]
                              for _ in range(num_tokens)])
    if skip_fraction:
        skip_TK = torch.rand(ids_TK.shape, generator=generator) < skip_fraction
        ids_TK = ids_TK.masked_fill(skip_TK, -1)
    return ids_TK.to(dtype)


def make_expert_inputs(generator: torch.Generator, num_tokens: int = 6, hidden_size: int = 8,
                       intermediate_size: int = 4, num_experts: int = 4, top_k: int = 2,
                       dtype: torch.dtype = torch.float32, bias: bool = False,
                       ids_dtype: torch.dtype = torch.int32, skip_fraction: float = 0.0,
                       hidden_scale: float = 1.0) -> ExpertInputs:
    """Random inputs whose outputs are O(hidden_scale): weights ~ 1/sqrt(fan_in)."""
    T, H, I, E, K = num_tokens, hidden_size, intermediate_size, num_experts, top_k

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=generator) * scale).to(dtype)

    return ExpertInputs(
        hidden_TH=randn(T, H, scale=hidden_scale),
        topk_weights_TK=torch.rand((T, K), generator=generator),
        topk_ids_TK=random_topk_ids(T, E, K, generator, ids_dtype, skip_fraction),
        w13_EFH=randn(E, 2 * I, H, scale=H ** -0.5),
        w2_EHI=randn(E, H, I, scale=I ** -0.5),
        b13_EF=randn(E, 2 * I, scale=0.5) if bias else None,
        b2_EH=randn(E, H, scale=0.5) if bias else None,
    )


@pytest.fixture
def expert_inputs(generator) -> Callable[..., ExpertInputs]:
    """``expert_inputs(**sizes)``: see `make_expert_inputs`."""
    return lambda **kwargs: make_expert_inputs(generator, **kwargs)


@pytest.fixture
def topk_ids(generator) -> Callable[..., torch.Tensor]:
    """``topk_ids(T, E, K, dtype=int32, skip_fraction=0.0)``: see `random_topk_ids`."""
    return lambda *args, **kwargs: random_topk_ids(*args, generator=generator, **kwargs)


@pytest.fixture
def poisoned_empty(monkeypatch) -> None:
    """Every buffer ``torch.empty`` / ``torch.empty_like`` make during the test starts
    as NaN (floats) or `INT_POISON` (integers), so a row a kernel forgets to write
    shows up in its output."""

    def poisoned(allocate):
        def allocate_poisoned(*args, **kwargs):
            t = allocate(*args, **kwargs)
            if t.is_floating_point():
                return t.fill_(math.nan)
            # Unsigned bytes (packed MXFP4, e8m0 scales) get their largest value.
            info = torch.iinfo(t.dtype)
            return t.fill_(INT_POISON if info.min <= INT_POISON else info.max)

        return allocate_poisoned

    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))


@dataclasses.dataclass
class QuantInputs:
    """The tensor arguments of ``moe::experts_quant``: `ExpertInputs`' weights
    quantized to ``spec`` (`torch_moe_ops.quant`), biases and activations unquantized."""

    spec: QuantSpec
    float_inputs: ExpertInputs
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor
    w2_scale: torch.Tensor

    def weight_args(self, activation: str = "silu", swiglu_alpha: float = 1.702,
                    swiglu_limit: float = 7.0) -> tuple:
        """Everything after the activations and routing, in schema order."""
        f = self.float_inputs
        return (self.w13, self.w2, self.w13_scale, self.w2_scale, f.b13_EF, f.b2_EH,
                self.spec.weights, self.spec.activations, self.spec.block_list, activation,
                swiglu_alpha, swiglu_limit)

    def args(self, *static) -> tuple:
        f = self.float_inputs
        return (f.hidden_TH, f.topk_weights_TK, f.topk_ids_TK, *self.weight_args(*static))

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``w13 [E, F, H]``, ``w2 [E, H, I]`` in fp32, as the quantized ones read back."""
        return (quant.dequantize_weights(self.w13, self.w13_scale, self.spec),
                quant.dequantize_weights(self.w2, self.w2_scale, self.spec))


def make_quant_inputs(generator: torch.Generator, spec: QuantSpec, **sizes) -> QuantInputs:
    """`make_expert_inputs` (same keywords) with the weights quantized to ``spec``."""
    f = make_expert_inputs(generator, **sizes)
    w13, w13_scale = quant.quantize_weights(f.w13_EFH, spec)
    w2, w2_scale = quant.quantize_weights(f.w2_EHI, spec)
    return QuantInputs(spec, f, w13, w2, w13_scale, w2_scale)


@pytest.fixture
def quant_inputs(generator) -> Callable[..., QuantInputs]:
    """``quant_inputs(spec, **sizes)``: see `make_quant_inputs`."""
    return lambda spec, **kwargs: make_quant_inputs(generator, spec, **kwargs)


@pytest.fixture
def sm90(monkeypatch):
    """``torch.cuda`` claims an sm90 GPU (sm set by ``sm90(major, minor)``)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def claim(major: int = 9, minor: int = 0):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major,
                                                                                      minor))

    claim()
    return claim


def why_not_after(backend, make_problem: Callable[..., object], sm90, changes: dict):
    """``backend.why_not`` on ``make_problem(**changes)`` of a claimed sm90 GPU, where
    ``changes`` may also name a ``device`` and another ``sm`` (``(major, minor)``)."""
    from torch_moe_ops.config import BackendSpec

    changes = dict(changes)
    device = changes.pop("device", torch.device("cuda"))
    sm90(*changes.pop("sm", (9, 0)))
    return backend.why_not(BackendSpec(), make_problem(**changes), device)


# The benchmark scripts' folder: they import each other by name, as when a script runs.
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def benchmarks_importable(monkeypatch):
    """The benchmarks' modules import each other by name, as when a script runs."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))


# torch.library.opcheck's checks that run on float8 arguments on the CPU: SchemaCheckMode
# compares inputs before and after with ops the CPU lacks for float8 (torch 2.13:
# "mul_cpu_reduced_float" not implemented), so its mutation check cannot run there.
FP8_CPU_OPCHECK_UTILS = tuple(u for u in torch.library._OPCHECK_DEFAULT_UTILS
                              if u != "test_schema")
