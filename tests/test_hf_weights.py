"""GPT-OSS's converted expert tensors follow the weights they were converted from.

Legend: B batch, S sequence, V vocabulary.

A patched GPT-OSS block keeps copies of ``gate_up_proj``, ``gate_up_proj_bias``
and ``down_proj`` in our layout. Whatever replaces or rewrites those weights
(``load_state_dict`` in place or with ``assign=True``, assigning parameters,
writing into them, ``.to()``), the block must not compute with the old copies.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

pytest.importorskip("transformers")

import torch_moe_ops as tmo
from test_hf import FP32_TOL, make_model, token_ids
from torch_moe_ops import hf

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

BLOCKS = ["model.layers.0.mlp", "model.layers.1.mlp"]


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


def write_in_place(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state``'s expert tensors into the parameters (bumps their versions)."""
    with torch.no_grad():
        for key, value in state.items():
            if ".experts." in key:
                model.get_parameter(key).copy_(value)


def assign_parameters(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Replace the expert parameters by new ones holding ``state``'s tensors."""
    for key, value in state.items():
        if ".experts." in key:
            module_name, _, name = key.rpartition(".")
            setattr(model.get_submodule(module_name), name, torch.nn.Parameter(value.clone()))


@pytest.mark.parametrize("assign", [False, True], ids=["in_place", "assign"])
def test_reload_then_patch_again_uses_new_weights(assign):
    model = make_model("gpt_oss")
    ids = token_ids()
    state = new_weights(model)
    want = unpatched_logits(state, ids)
    hf.patch(model)
    with torch.no_grad():
        old = model(ids).logits
        model.load_state_dict(state, assign=assign)
        got_after_load = model(ids).logits
        report = hf.patch(model)
        got_after_patch = model(ids).logits
    assert (old - want).abs().max() > 1.0  # the new weights visibly move the logits
    torch.testing.assert_close(got_after_load, want, **FP32_TOL)
    torch.testing.assert_close(got_after_patch, want, **FP32_TOL)
    assert report.patched == [] and report.refreshed == tuple(BLOCKS)
    assert set(report.skipped.values()) == {"already patched"}
    assert "reconverted the expert tensors of 2 blocks" in str(report)


@pytest.mark.parametrize("change", [write_in_place, assign_parameters])
def test_eager_forward_reconverts_changed_weights(change):
    """Changes that bypass load_state_dict: the next eager forward reconverts."""
    model = make_model("gpt_oss")
    ids = token_ids()
    state = new_weights(model)
    hf.patch(model)
    change(model, state)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, unpatched_logits(state, ids), **FP32_TOL)
    block = model.get_submodule(BLOCKS[0])
    assert block.refresh_converted() == ()  # fresh: nothing left to reconvert


def test_compiled_model_follows_load_state_dict_and_patch():
    """A compiled forward does not check the sources: load_state_dict reconverts
    when it loads, and patching again after any other change."""
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
        state = new_weights(model, seed=6)
        write_in_place(model, state)
        hf.patch(model)
        torch.testing.assert_close(compiled(ids).logits, unpatched_logits(state, ids),
                                   **FP32_TOL)
    # The reconversion wrote into the buffers the graph reads: nothing recompiled.
    assert counter.frame_count == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast_after_patch_equals_patch_after_cast(dtype):
    """``model.to(dtype)`` casts the converted buffers with their sources."""
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
    """deepcopy and torch.save copies reconvert from their own weights; a block
    patched under inference mode still reconverts outside it."""
    model = make_model("gpt_oss")
    ids = token_ids()
    state = new_weights(model)
    with torch.inference_mode():
        hf.patch(model)
    copied = copy.deepcopy(model)
    copied.load_state_dict(state)
    write_in_place(model, state)
    with torch.no_grad():
        want = unpatched_logits(state, ids)
        torch.testing.assert_close(copied(ids).logits, want, **FP32_TOL)
        torch.testing.assert_close(model(ids).logits, want, **FP32_TOL)
    with torch.inference_mode():
        torch.testing.assert_close(copy.deepcopy(model)(ids).logits, want, **FP32_TOL)
