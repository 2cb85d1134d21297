"""`tmo.explain` says what runs: a compiled model's own backend (not the keywords' defaults),
and whether a layer plans for training by what decides it, grad mode (not `eval()`); called
again and again in one process, it says the same each time and leaves the user's compiled
models as they were."""

from __future__ import annotations

import contextlib
import gc
import logging
import weakref

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounter

import torch_moe_ops as tmo
from tests.distributed import run_on_ranks
from torch_moe_ops.lowering import MoECompileBackend

H, I, E, K = 64, 32, 8, 2


def _moe(**cfg) -> tmo.MoE:
    return tmo.MoE(tmo.MoEConfig(**{"hidden_size": H, "intermediate_size": I, "num_experts": E,
                                    "top_k": K, **cfg}))


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


# Twelve `explain` calls, more than Dynamo's recompile limit (8 compilations of one code
# object): other models, token counts, backends asked for, grad modes and a compiled model.
# Each is (MoEConfig fields, tokens, explain's keywords, grad mode on, compiled with).
EXPLAIN_CALLS = [
    ({}, 5, {}, True, None),
    ({}, 9, {"experts": "reference"}, True, None),
    ({"num_experts": 16, "top_k": 4}, 5, {"experts": "cpu"}, True, None),
    ({"scoring": "sigmoid", "renormalize": True}, 3, {"route": "reference"}, True, None),
    ({"activation": "gelu"}, 7, {}, False, None),
    ({"shared_expert_intermediate_size": 16}, 5, {"experts": "reference"}, True, None),
    ({"hidden_size": 32}, 4, {}, True, None),
    ({}, 5, {}, True, {"experts": "reference", "route": "reference"}),
    ({"top_k": 1}, 6, {"experts": "reference"}, False, None),
    ({}, 11, {"chunks": 2}, True, None),
    ({"num_experts": 4}, 2, {"experts": "cpu"}, True, {"experts": "cpu"}),
    ({}, 5, {"experts": "reference"}, False, None),
]


def _model_and_input(cfg: dict, tokens: int, compiled_with: dict | None):
    moe = _moe(**cfg)
    model = (torch.compile(moe, backend=tmo.backend(**compiled_with))
             if compiled_with is not None else moe)
    return model, torch.randn(tokens, cfg.get("hidden_size", H))


def _explain(model, x_TH, keywords: dict, grad: bool) -> str:
    with contextlib.nullcontext() if grad else torch.no_grad():
        return str(tmo.explain(model, x_TH, **keywords))


@contextlib.contextmanager
def _dynamo_warnings():
    """The warnings Dynamo logs (a recompile limit hit among them), as they come."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    dynamo_log = logging.getLogger("torch._dynamo")
    dynamo_log.addHandler(handler)
    try:
        yield records
    finally:
        dynamo_log.removeHandler(handler)


def test_explain_called_again_and_again_says_each_time_what_a_first_call_says():
    calls = [(*_model_and_input(cfg, tokens, compiled_with), keywords, grad)
             for cfg, tokens, keywords, grad, compiled_with in EXPLAIN_CALLS]
    first_calls = []
    for model, x_TH, keywords, grad in calls:
        torch._dynamo.reset()
        first_calls.append(_explain(model, x_TH, keywords, grad))
    torch._dynamo.reset()
    with _dynamo_warnings() as warned:
        for index, (model, x_TH, keywords, grad) in enumerate(calls):
            assert _explain(model, x_TH, keywords, grad) == first_calls[index], index
    assert not [record.getMessage() for record in warned]
    assert all("no MoE layer was traced" not in said for said in first_calls)


def test_a_users_compiled_model_stays_compiled_across_explain_calls():
    moe = _moe()
    counter = CompileCounter()
    compiled = torch.compile(moe, backend=counter)
    x_TH = torch.randn(5, H)
    compiled(x_TH)
    for tokens in range(2, 2 + len(EXPLAIN_CALLS)):
        tmo.explain(moe if tokens % 2 else compiled, torch.randn(tokens, H))
    compiled(x_TH)
    assert counter.frame_count == 1  # its graph is still the one in Dynamo's cache
    # A new token count compiles it again (rather than running it uncompiled, as Dynamo
    # does past the recompile limit of its forward).
    compiled(torch.randn(7, H))
    assert counter.frame_count == 2


class _TwoLayersBrokenBetween(torch.nn.Module):
    """Two MoE layers (E and 4 experts) with a graph break between them: Dynamo compiles
    this forward as a frame of its own, and the rest of it after the break."""

    def __init__(self):
        super().__init__()
        self.first, self.second = _moe(), _moe(num_experts=4, top_k=1)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        x_TH = self.first(x_TH)
        torch._dynamo.graph_break()
        return self.second(x_TH)


def test_a_model_with_a_graph_break_is_explained_again_and_again():
    model = _TwoLayersBrokenBetween()
    with _dynamo_warnings() as warned:
        for tokens in range(2, 2 + len(EXPLAIN_CALLS)):
            explanation = tmo.explain(model, torch.randn(tokens, H))
            assert [report.plan.problem.num_local_experts for report in explanation] == [E, 4]
    assert not [record.getMessage() for record in warned]


def test_explain_leaves_nothing_of_its_own_in_dynamos_caches():
    moe = _moe()
    forward_entries = len(torch._dynamo.eval_frame._debug_get_cache_entry_list(tmo.MoE.forward))
    tmo.explain(moe, torch.randn(5, H), experts="reference")
    tmo.explain(torch.compile(moe, backend=tmo.backend(experts="reference")), torch.randn(5, H))
    assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(tmo.MoE.forward)) == \
        forward_entries
    # Nor a reference to the model: Dynamo keeps every backend it compiled with (for
    # `torch._dynamo.reset`), and explain's holds the model.
    explained = weakref.ref(moe)
    del moe
    gc.collect()
    assert explained() is None
