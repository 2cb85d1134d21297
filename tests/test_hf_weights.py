"""GPT-OSS's experts held in our layout: converted once, read by every forward,
saved and loaded in transformers' layout.

Legend: B batch, S sequence, V vocabulary, E experts, H hidden size, I expert
intermediate size, F = 2 * I.

A patched GPT-OSS block replaces ``gate_up_proj [E, H, F]`` (gate and up
interleaved), ``gate_up_proj_bias [E, F]`` and ``down_proj [E, I, H]`` by
parameters ``w13 [E, F, H]``, ``b13 [E, F]``, ``w2 [E, H, I]`` of the same experts
module. No forward may copy them again; ``state_dict``, ``save_pretrained`` and
``load_state_dict`` keep transformers' keys, order and layout.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

import torch_moe_ops as tmo
from test_hf import FP32_TOL, make_model, token_ids
from torch_moe_ops import hf

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

BLOCKS = ["model.layers.0.mlp", "model.layers.1.mlp"]
# Ours -> transformers' name of each converted expert tensor.
CONVERTED = {"w13": "gate_up_proj", "b13": "gate_up_proj_bias", "w2": "down_proj"}


def new_weights(model: torch.nn.Module, seed: int = 5) -> dict[str, torch.Tensor]:
    """``model``'s state dict with every expert tensor moved by O(initializer_range)."""
    generator = torch.Generator().manual_seed(seed)
    return {key: value + 0.2 * torch.randn(value.shape, generator=generator).to(value.dtype)
            if ".experts." in key else value.clone()
            for key, value in model.state_dict().items()}


def unpatched_logits(state: dict[str, torch.Tensor], ids_BS: torch.Tensor) -> torch.Tensor:
    """``[B, S, V]`` logits of the unpatched GPT-OSS model holding ``state``."""
    model = make_model("gpt_oss")
    model.load_state_dict(state)
    with torch.no_grad():
        return model(ids_BS).logits


def our_expert_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The converted expert parameters of the patched blocks, by their model names."""
    return {f"{block}.experts.{name}": model.get_parameter(f"{block}.experts.{name}")
            for block in BLOCKS for name in CONVERTED}


class ExpertsArguments(TorchDispatchMode):
    """The storage addresses of the tensors every ``moe::experts`` call receives."""

    def __init__(self):
        super().__init__()
        self.data_ptrs: list[set[int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() == "moe::experts":
            self.data_ptrs.append({a.data_ptr() for a in args if isinstance(a, torch.Tensor)})
        return func(*args, **(kwargs or {}))


def test_experts_are_parameters_in_our_layout():
    model = make_model("gpt_oss")
    before = {f"{block}.experts.{name}": model.get_parameter(f"{block}.experts.{name}").detach()
              for block in BLOCKS for name in CONVERTED.values()}
    report = hf.patch(model)
    assert [b.converted for b in report.blocks] == [tuple(CONVERTED.values())] * 2
    for name, param in our_expert_parameters(model).items():
        block, _, ours = name.rpartition(".experts.")
        source = before[f"{block}.experts.{CONVERTED[ours]}"]
        conversion = model.get_submodule(block).conversions[ours]
        assert param.is_leaf and param.requires_grad and param.is_contiguous()
        torch.testing.assert_close(conversion.to_source(param.detach()), source, rtol=0, atol=0)
    experts = model.get_submodule(BLOCKS[0]).experts
    # In transformers' order, ours in place of its own.
    assert [name for name, _ in experts.named_parameters()] == ["w13", "b13", "w2",
                                                                "down_proj_bias"]
    w13_EFH, w2_EHI, b13_EF, b2_EH = model.get_submodule(BLOCKS[0]).expert_weights()
    assert (w13_EFH, w2_EHI, b13_EF, b2_EH) == (experts.w13, experts.w2, experts.b13,
                                                experts.down_proj_bias)
    E, H, I = 8, 32, 24
    assert (w13_EFH.shape, w2_EHI.shape, b13_EF.shape) == ((E, 2 * I, H), (E, H, I), (E, 2 * I))


@pytest.mark.parametrize("mode", ["no_grad", "eval_with_grad", "train", "generate"])
def test_no_forward_copies_the_experts(mode):
    """Every forward hands ``moe::experts`` the parameters themselves: a conversion
    per forward would hand it new tensors."""
    model = make_model("gpt_oss")
    hf.patch(model)
    params = {param.data_ptr() for param in our_expert_parameters(model).values()}
    ids = token_ids()
    with ExpertsArguments() as seen:
        if mode == "generate":
            with torch.no_grad():
                model.generate(ids[:1], max_new_tokens=3, min_new_tokens=3, do_sample=False)
        elif mode == "no_grad":
            with torch.no_grad():
                model(ids)
        else:
            model.train(mode == "train")
            model(ids, labels=ids).loss.backward()
    expected_calls = 2 * (3 if mode == "generate" else 1)
    assert len(seen.data_ptrs) == expected_calls
    for data_ptrs in seen.data_ptrs:
        assert len(data_ptrs & params) == len(CONVERTED)
    if mode in ("eval_with_grad", "train"):
        assert all(p.grad is not None for p in our_expert_parameters(model).values())


def test_state_dict_is_transformers():
    model = make_model("gpt_oss")
    want = model.state_dict()
    hf.patch(model)
    got = model.state_dict()
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key].shape == value.shape and got[key].dtype == value.dtype, key
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    # A copy: writing into it leaves the parameters alone.
    w13 = model.get_parameter(f"{BLOCKS[0]}.experts.w13").detach().clone()
    got[f"{BLOCKS[0]}.experts.gate_up_proj"].zero_()
    assert torch.equal(model.get_parameter(f"{BLOCKS[0]}.experts.w13"), w13)


@pytest.mark.parametrize("assign", [False, True], ids=["in_place", "assign"])
def test_load_state_dict_refreshes(assign):
    model = make_model("gpt_oss")
    ids = token_ids()
    state = new_weights(model)
    want = unpatched_logits(state, ids)
    hf.patch(model)
    params = our_expert_parameters(model)
    with torch.no_grad():
        old = model(ids).logits
        model.load_state_dict(state, assign=assign)
        got = model(ids).logits
    assert (old - want).abs().max() > 1.0  # the new weights visibly move the logits
    torch.testing.assert_close(got, want, **FP32_TOL)
    after = our_expert_parameters(model)
    if not assign:  # the same parameters: optimizers and compiled graphs keep them
        assert all(after[name] is param for name, param in params.items())
    assert all(isinstance(param, torch.nn.Parameter) for param in after.values())


def test_bad_state_dict_names_transformers_key():
    model = make_model("gpt_oss")
    state = model.state_dict()
    hf.patch(model)
    key = f"{BLOCKS[1]}.experts.gate_up_proj"
    state[key] = state[key][:, :-1]
    with pytest.raises(RuntimeError, match=rf"size mismatch for {key}: copying a param with "
                                           r"shape \(8, 31, 48\).*is \(8, 32, 48\)"):
        model.load_state_dict(state)


def test_save_pretrained_round_trip(tmp_path):
    """A patched model saves transformers' checkpoint: it loads into transformers
    unpatched, and patched again computes what the saved model did."""
    model = make_model("gpt_oss")
    unpatched = copy.deepcopy(model)
    hf.patch(model)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, unpatched(ids).logits, rtol=0, atol=0)
        hf.patch(loaded)
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_compiled_model_follows_load_state_dict():
    """load_state_dict writes into the parameters a compiled graph reads: no recompile."""
    model = make_model("gpt_oss")
    ids = token_ids()
    state = new_weights(model)
    hf.patch(model)
    counter = CompileCounterWithBackend(tmo.backend(inner="aot_eager"))
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        compiled(ids)
        model.load_state_dict(state)
        torch.testing.assert_close(compiled(ids).logits, unpatched_logits(state, ids),
                                   **FP32_TOL)
    assert counter.frame_count == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast_after_patch_equals_patch_after_cast(dtype):
    patched_first = make_model("gpt_oss")
    hf.patch(patched_first)
    patched_first.to(dtype)
    cast_first = make_model("gpt_oss", dtype=dtype)
    hf.patch(cast_first)
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(patched_first(ids).logits, cast_first(ids).logits,
                                   rtol=0, atol=0)
    for name in BLOCKS:
        got, want = patched_first.get_submodule(name), cast_first.get_submodule(name)
        for got_tensor, want_tensor in zip(got.expert_weights(), want.expert_weights()):
            assert got_tensor.dtype == dtype
            torch.testing.assert_close(got_tensor, want_tensor, rtol=0, atol=0)


def test_copies_and_inference_mode():
    """A model patched under inference mode trains outside it; a deepcopy holds its
    own parameters and keeps the state-dict hooks."""
    model = make_model("gpt_oss")
    ids = token_ids()
    state = new_weights(model)
    with torch.inference_mode():
        hf.patch(model)
    assert not any(torch.is_inference(p) for p in our_expert_parameters(model).values())
    model(ids, labels=ids).loss.backward()
    copied = copy.deepcopy(model)
    copied.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(copied(ids).logits, unpatched_logits(state, ids), **FP32_TOL)
    assert list(copied.state_dict()) == list(state)
