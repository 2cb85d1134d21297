"""The eager kernels of the generic ops choose their backend once per (op, problem, device)
(`registry.EagerChoices`): ``supports`` runs on the first call of a key, and again only
where what it reads changed (another problem or device, a backend registered or replaced, an
environment variable a backend's ``supports`` reads).

Legend: T tokens, H hidden size, I expert intermediate size, E experts, K experts per token.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torch_moe_ops.backends.registry import REGISTRY, EagerChoices, Problem, Registry
from torch_moe_ops.config import BackendSpec

STATIC = ("silu", 1.702, 7.0)
CPU = torch.device("cpu")


def _experts_args(hidden_size=16, dtype=torch.float32, num_tokens=5):
    generator = torch.Generator().manual_seed(0)
    num_experts, inter, top_k = 4, 8, 2
    hidden_TH = torch.randn(num_tokens, hidden_size, generator=generator).to(dtype)
    weights_TK = torch.rand(num_tokens, top_k, generator=generator)
    ids_TK = torch.rand(num_tokens, num_experts, generator=generator).topk(top_k).indices
    w13_EFH = torch.randn(num_experts, 2 * inter, hidden_size, generator=generator).to(dtype)
    w2_EHI = torch.randn(num_experts, hidden_size, inter, generator=generator).to(dtype)
    return (hidden_TH, weights_TK, ids_TK.to(torch.int32), w13_EFH, w2_EHI, None, None, *STATIC)


@pytest.fixture
def supports_calls(monkeypatch):
    """Each experts backend's ``supports`` counts its calls (replacing the backends is a
    change of the registry: the choices made before are made again)."""
    calls = {name: 0 for name in REGISTRY.experts}

    def counting(name, supports):
        def counted(spec, problem, device):
            calls[name] += 1
            return supports(spec, problem, device)
        return counted

    for name, backend in list(REGISTRY.experts.items()):
        monkeypatch.setitem(REGISTRY.experts, name, dataclasses.replace(
            backend, supports=counting(name, backend.supports)))
    return calls


def test_the_eager_choice_runs_supports_once_per_problem(supports_calls):
    for _ in range(3):
        torch.ops.moe.experts(*_experts_args())
    assert supports_calls["cpu"] == 1, supports_calls
    torch.ops.moe.experts(*_experts_args(hidden_size=32))
    torch.ops.moe.experts(*_experts_args(dtype=torch.bfloat16))
    torch.ops.moe.experts(*_experts_args(hidden_size=32))
    # One choice more per new problem.
    assert supports_calls["cpu"] == 3, supports_calls


def test_a_backend_replaced_is_chosen_again(supports_calls):
    torch.ops.moe.experts(*_experts_args())
    cpu = REGISTRY.experts["cpu"]
    REGISTRY.experts["cpu"] = dataclasses.replace(cpu, supports=lambda *_: "replaced")
    torch.ops.moe.experts(*_experts_args())
    REGISTRY.experts["cpu"] = cpu
    torch.ops.moe.experts(*_experts_args())
    assert supports_calls["cpu"] == 2, supports_calls


def _counting_registry(variable: str | None = None):
    """A registry of the reference backend alone, named ``variable`` as what its supports
    reads, and `EagerChoices` of it with a count of its choices."""
    registry, chosen = Registry(), []
    reference = REGISTRY.experts["reference"]
    registry.register_experts(dataclasses.replace(
        reference, environment=(variable,) if variable else ()))

    def choose(op_name, problem, device):
        chosen.append(op_name)
        return registry.choose_experts(BackendSpec(), problem, device).namespace

    return registry, EagerChoices(registry, choose), chosen


def test_the_key_covers_op_problem_device_and_the_environment_read(monkeypatch):
    variable = "TORCH_MOE_OPS_TEST_SUPPORTS_READS"
    monkeypatch.delenv(variable, raising=False)
    registry, choices, chosen = _counting_registry(variable)
    problem = Problem(torch.float32, hidden_size=16)
    for _ in range(3):
        assert choices.namespace("experts", problem, CPU) == "moe_reference"
    choices.namespace("experts_rows", problem, CPU)
    choices.namespace("experts", dataclasses.replace(problem, training=True), CPU)
    choices.namespace("experts", problem, torch.device("meta"))
    assert len(chosen) == 4, chosen
    monkeypatch.setenv(variable, "1")
    choices.namespace("experts", problem, CPU)
    choices.namespace("experts", problem, CPU)
    registry.changed()
    choices.namespace("experts", problem, CPU)
    assert len(chosen) == 6, chosen


def test_a_choice_that_fails_fails_on_every_call():
    registry, choices, chosen = _counting_registry()
    registry.experts = {}
    for _ in range(2):
        with pytest.raises(ValueError, match="no experts backend runs"):
            choices.namespace("experts", Problem(torch.float32), CPU)
    assert len(chosen) == 2
