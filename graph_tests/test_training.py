"""Training under torch.compile: a whole step (forward, loss, backward, SGD update)
is one graph with no break, and its losses, gradients and updated parameters are
those of the eager step and of the ``reference`` experts backend; activation
checkpointing and repeated runs give the same gradients. GPU: the step captured
in CUDA graphs (``mode="reduce-overhead"``) on the ``triton`` and ``grouped_mm``
experts, in bf16, against an fp32 eager reference.

Legend: B batch, S sequence, T tokens, H hidden size.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import torch_moe_ops as tmo
from graph_tests.aot_graphs import AotGraphs
from graph_tests.toy_model import CONFIGS, make_model
from torch_moe_ops.backends.registry import REGISTRY, Problem

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

MODEL_NAMES = sorted(CONFIGS)
LR = 0.1
# Two steps: the second runs on the parameters the first updated, so a graph that
# read stale weights or recompiled after an update would show.
STEPS = 2
# The same kernels (aot_eager runs the graph op by op) agree to rounding; Inductor
# fuses and reorders; the reference experts backend sums per expert, densely.
SAME_KERNELS = {"rtol": 1e-5, "atol": 1e-6}
FUSED = {"rtol": 1e-4, "atol": 1e-5}
REFERENCE = {"rtol": 1e-4, "atol": 1e-5}


def train_step(model: nn.Module, ids_BS: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """One training step: forward, cross-entropy, backward, SGD update; the loss."""
    logits = model(ids_BS)
    loss = F.cross_entropy(logits.flatten(0, 1), targets_BS.flatten())
    loss.backward()
    with torch.no_grad():
        params = list(model.parameters())
        # The update written out: torch.optim's step() breaks the graph on purpose
        # (pytorch#104053), so a whole step with it is never one graph.
        torch._foreach_add_(params, [p.grad for p in params], alpha=-LR)
    return loss.detach()


@pytest.fixture
def traced_backward():
    """Dynamo traces ``Tensor.backward()`` into the step's graph (as
    ``autograd.grad`` and the gradients' assignment) only with ``trace_autograd_ops``;
    without it the call is a graph break."""
    if not hasattr(torch._dynamo.config, "trace_autograd_ops"):
        pytest.skip("this torch's Dynamo cannot trace Tensor.backward() (no trace_autograd_ops)")
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        yield


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    ids_BS = torch.randint(0, 64, (2, 8), generator=generator)
    return ids_BS, torch.randint(0, 64, (2, 8), generator=generator)


def _train(model: nn.Module, step_fn, steps: int = STEPS) -> list[torch.Tensor]:
    """The losses of ``steps`` steps on fresh batches. Gradients are set to None
    before each step, as ``optimizer.zero_grad()`` does."""
    losses = []
    for step in range(steps):
        model.zero_grad()
        losses.append(step_fn(model, *_batch(step)))
    return losses


def _on_reference(model: nn.Module) -> nn.Module:
    """``model`` with its experts on the ``reference`` backend (the oracle), run op
    by op: its graph is lowered to the reference ops, then run as it is."""
    return torch.compile(model, backend=tmo.backend(experts="reference", inner="eager"),
                         fullgraph=True)


def _assert_trained_alike(model, losses, expected_model, expected_losses, tolerance) -> None:
    """The same losses, last gradients and updated parameters; the models are built
    alike, so their parameters pair up in order."""
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected_losses), **tolerance)
    for (name, param), expected in zip(model.named_parameters(), expected_model.parameters(),
                                       strict=True):
        torch.testing.assert_close(param.grad, expected.grad, **tolerance,
                                   msg=lambda m, name=name: f"{name}.grad: {m}")
        torch.testing.assert_close(param.detach(), expected.detach(), **tolerance,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _snapshot(model: nn.Module, losses) -> list[torch.Tensor]:
    """Losses, gradients and parameters, copied."""
    return [*losses, *(p.grad.clone() for p in model.parameters()),
            *(p.detach().clone() for p in model.parameters())]


def _assert_bitwise_equal(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert torch.equal(a, e), f"tensor {i} differs: max |diff| {(a - e).abs().max()}"


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_training_step_is_one_graph_matching_eager_and_reference(name, traced_backward):
    compiled_model, eager_model, reference_model = (make_model(name) for _ in range(3))
    counter = CompileCounterWithBackend(tmo.backend(inner="aot_eager"))
    losses = _train(compiled_model, torch.compile(train_step, backend=counter, fullgraph=True))

    # One graph for both steps (fullgraph=True raises on a break): the backward
    # and the update are in it, not run eagerly after it.
    assert counter.frame_count == 1
    code = counter.graphs[0].code
    assert "torch.autograd.grad(" in code and "_foreach_add_" in code
    _assert_trained_alike(compiled_model, losses, eager_model,
                          _train(eager_model, train_step), SAME_KERNELS)
    _assert_trained_alike(compiled_model, losses, reference_model,
                          _train(_on_reference(reference_model), train_step), REFERENCE)


@pytest.mark.slow
def test_inductor_training_step_matches_eager_and_is_deterministic(traced_backward):
    compiled_model, eager_model = make_model("deepseek", num_layers=1), make_model(
        "deepseek", num_layers=1)
    initial = copy.deepcopy(compiled_model.state_dict())
    counter = CompileCounterWithBackend(tmo.backend())
    compiled_step = torch.compile(train_step, backend=counter, fullgraph=True)
    losses = _train(compiled_model, compiled_step)
    assert counter.frame_count == 1
    _assert_trained_alike(compiled_model, losses, eager_model,
                          _train(eager_model, train_step), FUSED)

    # The same steps from the same start, on the same compiled graph: the same bits.
    first = _snapshot(compiled_model, losses)
    compiled_model.load_state_dict(initial)
    _assert_bitwise_equal(_snapshot(compiled_model, _train(compiled_model, compiled_step)),
                          first)
    assert counter.frame_count == 1


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_training_is_deterministic(compiled, traced_backward):
    model = make_model("qwen2_moe")
    initial = copy.deepcopy(model.state_dict())
    step_fn = (torch.compile(train_step, backend=tmo.backend(inner="aot_eager"), fullgraph=True)
               if compiled else train_step)
    first = _snapshot(model, _train(model, step_fn))
    model.load_state_dict(initial)
    _assert_bitwise_equal(_snapshot(model, _train(model, step_fn)), first)


class Checkpointed(nn.Module):
    """``module`` under activation checkpointing: what its forward saves for the
    backward is recomputed there instead of being kept."""

    def __init__(self, module: nn.Module, use_reentrant: bool):
        super().__init__()
        self.module = module
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.module, x, use_reentrant=self.use_reentrant)


def _checkpointed(model: nn.Module, use_reentrant: bool = False) -> nn.Module:
    for block in model.blocks:
        block.moe = Checkpointed(block.moe, use_reentrant)
    return model


class ExpertsCalls(TorchDispatchMode):
    """Counts the forward calls of ``moe::experts`` the eager model makes."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.moe.experts.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_moe_gives_the_same_gradients(use_reentrant):
    model, checkpointed = make_model("deepseek"), _checkpointed(make_model("deepseek"),
                                                                use_reentrant)
    with ExpertsCalls() as plain_calls:
        losses = _train(model, train_step, steps=1)
    with ExpertsCalls() as checkpointed_calls:
        checkpointed_losses = _train(checkpointed, train_step, steps=1)
    # Two layers: each runs its experts once, and once more when checkpointed.
    assert (plain_calls.count, checkpointed_calls.count) == (2, 4)
    # The recomputation repeats the forward exactly: the same bits.
    _assert_trained_alike(checkpointed, checkpointed_losses, model, losses,
                          {"rtol": 0, "atol": 0})


def test_compiled_checkpointed_moe_recomputes_on_the_chosen_backend():
    model = _checkpointed(make_model("gpt_oss"))
    graphs = AotGraphs(tmo.BackendSpec(experts="reference"))
    losses = _train(torch.compile(model, backend=graphs, fullgraph=True), train_step, steps=1)
    forward, backward = graphs.codes
    # The checkpointed region is a higher-order op's body, lowered like the rest:
    # its experts run the chosen backend, and the backward recomputes the routing
    # it needs (the reference route's torch ops) instead of saving it.
    assert "torch.ops.moe_reference.experts.default(" in forward
    assert "aten.topk" in backward
    for generic in ("torch.ops.moe.route.default(", "torch.ops.moe.experts.default("):
        assert not any(generic in code for code in graphs.codes), generic
    plain = make_model("gpt_oss")
    _assert_trained_alike(model, losses, plain, _train(plain, train_step, steps=1), REFERENCE)


def test_checkpointed_training_step_is_one_graph(traced_backward):
    model, plain = _checkpointed(make_model("mixtral")), make_model("mixtral")
    counter = CompileCounterWithBackend(tmo.backend(inner="aot_eager"))
    losses = _train(model, torch.compile(train_step, backend=counter, fullgraph=True))
    assert counter.frame_count == 1
    assert "tag_activation_checkpoint" in counter.graphs[0].code
    _assert_trained_alike(model, losses, plain, _train(plain, train_step), SAME_KERNELS)


# GPU: one MoE layer on given tokens, so that the compiled step and the eager
# reference route identically (the router runs in fp32 on the same bf16 values);
# behind other bf16 layers, near-ties in routing would flip between them.
GPU_CONFIG = tmo.MoEConfig(hidden_size=256, intermediate_size=128, num_experts=16, top_k=4,
                           renormalize=True)
GPU_TOKENS = 64
GPU_EXPERTS = ("triton", "grouped_mm")
# bf16 against fp32 (as tests/conftest.py's GRAD_TOLERANCES): relative, and absolute
# as a fraction of the largest expected magnitude.
BF16_GRAD_TOLERANCE = 3e-2


def _skip_unless_available(experts: str) -> None:
    reason = REGISTRY.experts[experts].supports(
        tmo.BackendSpec(experts=experts), Problem.from_config(GPU_CONFIG, torch.bfloat16),
        torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"experts backend {experts!r}: {reason}")


def _gpu_moe() -> tuple[tmo.MoE, tmo.MoE]:
    """A bf16 layer and its fp32 copy (the same values), the eager reference."""
    torch.manual_seed(0)
    moe = tmo.MoE(GPU_CONFIG, device="cuda", dtype=torch.bfloat16)
    return moe, copy.deepcopy(moe).float()


def _gpu_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(step)
    x_TH = torch.randn(GPU_TOKENS, GPU_CONFIG.hidden_size, device="cuda", generator=generator)
    target_TH = torch.randn(x_TH.shape, device="cuda", generator=generator)
    return x_TH.bfloat16(), target_TH


def moe_loss(moe: tmo.MoE, x_TH: torch.Tensor, target_TH: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(moe(x_TH.to(moe.w13.dtype)).float(), target_TH)


def moe_train_step(moe: tmo.MoE, x_TH: torch.Tensor, target_TH: torch.Tensor) -> torch.Tensor:
    """Forward, loss and backward of one layer; the loss."""
    loss = moe_loss(moe, x_TH, target_TH)
    loss.backward()
    return loss.detach()


def _assert_grads_close_to_reference(moe: tmo.MoE, reference: tmo.MoE) -> None:
    for (name, param), expected in zip(moe.named_parameters(), reference.parameters(),
                                       strict=True):
        scale = expected.grad.abs().max().item()
        assert scale > 0, f"{name}: the reference gradient is zero"
        torch.testing.assert_close(param.grad.float(), expected.grad,
                                   rtol=BF16_GRAD_TOLERANCE, atol=BF16_GRAD_TOLERANCE * scale,
                                   msg=lambda m, name=name: f"{name}.grad: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("experts", GPU_EXPERTS)
def test_reduce_overhead_training_step_replays_cuda_graphs(experts):
    """Forward and loss compiled with CUDA graphs, the backward compiled with them
    too, an eager SGD step between steps: every step's gradients match the fp32
    eager reference at the current weights, and after the warm-up step and the
    recording step the two graphs only replay."""
    _skip_unless_available(experts)
    moe, reference = _gpu_moe()
    compiled_loss = torch.compile(
        lambda x_TH, target_TH: moe_loss(moe, x_TH, target_TH),
        backend=tmo.backend(experts=experts, mode="reduce-overhead"), fullgraph=True)
    optimizer = torch.optim.SGD(moe.parameters(), lr=LR)
    torch._dynamo.utils.counters.clear()
    for step in range(4):
        x_TH, target_TH = _gpu_batch(step)
        reference.load_state_dict(moe.state_dict())
        reference.zero_grad()
        moe_loss(reference, x_TH, target_TH).backward()
        # The backward graph's outputs become the gradients, in memory its next
        # replay reuses: none may outlive the step (set to None, not zeroed).
        moe.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        compiled_loss(x_TH, target_TH).backward()
        _assert_grads_close_to_reference(moe, reference)
        optimizer.step()
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
    # Step 0 warms up, step 1 records the forward and the backward, steps 2 and 3
    # replay them: the tree holds exactly two graphs.
    tree_manager = torch._inductor.cudagraph_trees.get_container(0).tree_manager
    assert next(tree_manager.graph_counter) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("experts", [None, *GPU_EXPERTS], ids=["eager", *GPU_EXPERTS])
def test_gpu_training_step_is_deterministic(experts, traced_backward):
    """The step (eager, or compiled whole by Inductor) run twice on the same tokens
    and weights gives the same bits, and gradients that match the fp32 reference."""
    if experts is not None:
        _skip_unless_available(experts)
    moe, reference = _gpu_moe()
    step_fn = moe_train_step if experts is None else torch.compile(
        moe_train_step, backend=tmo.backend(experts=experts), fullgraph=True)
    x_TH, target_TH = _gpu_batch(0)
    runs = []
    for _ in range(2):
        moe.zero_grad()
        loss = step_fn(moe, x_TH, target_TH)
        runs.append([loss, *(p.grad.clone() for p in moe.parameters())])
    _assert_bitwise_equal(runs[1], runs[0])
    moe_train_step(reference, x_TH, target_TH)
    _assert_grads_close_to_reference(moe, reference)
