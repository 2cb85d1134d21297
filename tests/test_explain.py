"""`tmo.explain` says what runs: a compiled model's own backend (not the keywords' defaults),
and whether a layer plans for training by what decides it, grad mode (not `eval()`)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import torch_moe_ops as tmo
from tests.distributed import run_on_ranks
from torch_moe_ops.lowering import MoECompileBackend

H, I, E, K = 64, 32, 8, 2


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each `explain` compiles `MoE.forward` with a backend of its own: past Dynamo's
    recompile limit (8 per code object) the forward runs uncompiled and traces no layer."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _moe(**cfg) -> tmo.MoE:
    return tmo.MoE(tmo.MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K,
                                 **cfg))


def test_a_compiled_model_is_explained_with_its_backends_spec():
    compiled = torch.compile(_moe(), backend=tmo.backend(experts="reference", route="reference"))
    explanation = tmo.explain(compiled, torch.randn(5, H))
    (report,) = explanation
    assert (report.plan.experts.name, report.route.route.name) == ("reference", "reference")
    assert str(explanation).startswith(
        "compiled with tmo.backend(experts='reference', a2a='none', dispatch_dtype=None, "
        "route='reference', chunks=None, overlap=False): what it runs\n"), str(explanation)
    # Keywords that agree with the model's backend are welcome.
    (agreeing,) = tmo.explain(compiled, torch.randn(5, H), experts="reference")
    assert agreeing.plan.experts.name == "reference"


@pytest.mark.parametrize(("options", "says"), [
    ({"backend": "moe"}, "compiled with backend='moe', tmo.backend()'s automatic choice ("),
    ({}, ("compiled with inductor, which leaves the MoE ops to their eager kernels: they run "
          "tmo.backend()'s defaults (")),
    ({"backend": "eager"}, "compiled with eager, which leaves the MoE ops to their eager kernels"),
], ids=["moe", "inductor", "eager"])
def test_a_model_compiled_otherwise_says_what_runs_it(options, says):
    explanation = tmo.explain(torch.compile(_moe(), **options), torch.randn(5, H))
    (report,) = explanation
    assert report.plan.experts.name == tmo.explain(_moe(), torch.randn(5, H))[0].plan.experts.name
    assert explanation.source.startswith(says), explanation.source


@pytest.mark.parametrize("backend", [tmo.backend(experts="reference"), "inductor"])
def test_keywords_that_disagree_with_a_compiled_models_backend_name_both(backend):
    compiled = torch.compile(_moe(), backend=backend)
    own = "reference" if isinstance(backend, MoECompileBackend) else "auto"
    with pytest.raises(ValueError, match=(
            rf"model is compiled with .*, which runs experts='{own}', chunks=None; explain got "
            r"experts='cpu', chunks=2: .* pass the uncompiled module")):
        tmo.explain(compiled, torch.randn(5, H), experts="cpu", chunks=2)


def _check_expert_parallel_under_inductor_refused(rank, world_size):
    sharded = tmo.MoE(tmo.MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K,
                                    ep_size=world_size, max_tokens_per_rank=4),
                      ep_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="leaves an expert-parallel layer to its eager kernels"):
        tmo.explain(torch.compile(sharded), torch.randn(2, H))


def test_an_expert_parallel_model_compiled_with_inductor_is_refused():
    run_on_ranks(2, _check_expert_parallel_under_inductor_refused)


def test_gradients_decide_training_not_eval():
    moe = _moe().eval()
    (report,) = tmo.explain(moe, torch.randn(5, H))
    assert report.plan.problem.training
    assert ("  gradients: recorded (grad mode is on, and eval() leaves it on), so it plans for "
            "training; under torch.no_grad() or torch.inference_mode() it plans for "
            "inference") in str(report).splitlines(), str(report)
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            (report,) = tmo.explain(moe, torch.randn(5, H))
        assert not report.plan.problem.training
        assert "  gradients: not recorded (" in str(report), str(report)
        assert "training" not in str(report), str(report)
