"""The ``flashinfer`` experts backend (FlashInfer's CUTLASS fused MoE).

Legend: T tokens, H hidden size, I expert intermediate size, F = 2 * I, E experts,
K experts per token, R rows.

On the CPU, with FlashInfer replaced by tests/flashinfer_emulator.py (what its
kernels compute, in plain PyTorch, with its binding's checks): the layout
conversion and the weight cache, both ops of both formats against the reference
backend, what `supports` says (not installed, not sm90, module not built, with
the build command; dtypes, activations, formats, sizes), that nothing builds the
module but `build` (not import, not `available_backends`, not a choice of
backend), the build's progress report and command line, and the registry's row.

On an sm90 GPU where flashinfer-python is installed and its fused-MoE module is
built (``gpu`` marker; each test skips, saying why, elsewhere: the reason names the
build command): the real kernels against the reference in bf16, fp8 blocks and mxfp4
at the widths of the benchmarks' five models (fewer experts), T = 0, 1, 7, 256 (4096
at three widths) with skipped slots, CUDA-graph capture and replay, and a compiled
`tmo.MoE` (fullgraph; Inductor, and ``mode="reduce-overhead"``). Error bounds are
relative Frobenius errors against the reference: `BF16_BOUND` for bf16 outputs (the
kernels also round the activation to bf16 before the second GEMM; mxfp4 weights read
back exactly in bf16, so they share it), `FP8_BOUND` where that bf16 rounding also
moves some values to the other fp8 neighbour (as in tests/test_grouped_mm_quant.py).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

import flashinfer_emulator
import torch_moe_ops as tmo
from torch_moe_ops import quant
from torch_moe_ops.backends.dispatch_dtype import (
    DEFAULT_RULE,
    DispatchSides,
    resolve_dispatch_dtype,
)
from torch_moe_ops.backends.flashinfer import cutlass_module, cutlass_symbols, library, tuning
from torch_moe_ops.backends.flashinfer import experts as backend
from torch_moe_ops.backends.registry import REGISTRY, ROWS, TOKENS, Problem
from torch_moe_ops.config import BackendSpec, QuantSpec

BF16_BOUND = 1e-2
# FlashInfer quantizes the hidden rows and the intermediate with kernels of its own: where a
# value sits at an fp8 rounding boundary it moves by a whole fp8 step against the
# reference. Measured on an H200 (2026-11-26): 1.8-2.1e-2 at T >= 7, 3.04e-2 at T = 1 (one
# token, the fewest terms).
FP8_BOUND = 4e-2
CUDA = torch.device("cuda")
CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parent.parent
FP8_BLOCK = QuantSpec("fp8_block")
MXFP4 = QuantSpec("mxfp4")
# The trimmed module's name (cutlass_spec), off an H20.
MODULE = "torch_moe_ops_fused_moe_90"
AOT_PATH = Path(f"/aot/{MODULE}.so")
BUILD_HINT = ("build it once with `python -m torch_moe_ops.backends.flashinfer build` (or "
              "`scripts/flashinfer_build.sh`, detached), or set "
              "TORCH_MOE_OPS_FLASHINFER_BUILD=1 to let the first call build it")


def relative_error(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12)).item()


@pytest.fixture
def emulated(monkeypatch, tmp_path):
    """``import flashinfer`` finds tests/flashinfer_emulator.py; its JIT cache is
    empty, under ``tmp_path``."""
    for name, module in flashinfer_emulator.MODULES.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(flashinfer_emulator.jit_env, "FLASHINFER_JIT_DIR", tmp_path / "jit")
    flashinfer_emulator.BUILDS.clear()
    flashinfer_emulator.CALLS.clear()
    flashinfer_emulator.PROFILED.clear()
    flashinfer_emulator.TUNE_OPTIONS.clear()
    flashinfer_emulator.AOT_ARTIFACTS.clear()
    tuning.forget_tuned_shapes()
    monkeypatch.delenv(tuning.AUTOTUNE_ENV, raising=False)
    monkeypatch.delenv(tuning.CACHE_ENV, raising=False)
    monkeypatch.delenv(cutlass_module.BUILD_ENV, raising=False)
    library.missing.cache_clear()
    cutlass_module.check_symbols.cache_clear()
    yield flashinfer_emulator
    library.missing.cache_clear()
    cutlass_module.check_symbols.cache_clear()


@pytest.fixture
def built(emulated):
    """The emulated module, built."""
    cutlass_module.build(verbose=False)
    emulated.BUILDS.clear()
    return emulated


@pytest.fixture
def gpu(monkeypatch):
    """``torch.cuda`` claims a GPU of compute capability ``gpu(major, minor)`` (sm90 first)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # Other backends' `supports` ask which GPU is current (the a2a's NVLink check).
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def claim(major: int = 9, minor: int = 0):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major,
                                                                                      minor))

    claim()
    return claim


@pytest.fixture(autouse=True)
def empty_cache():
    backend.clear_prepared_weights()
    yield
    backend.clear_prepared_weights()


def problem(dtype=torch.bfloat16, spec=None, hidden=4096, inter=1024, activation="silu"):
    return Problem(dtype, num_experts=8, num_local_experts=8, hidden_size=hidden,
                   intermediate_size=inter, top_k=2, activation=activation, quant=spec)


def reason(spec=None, **kwargs):
    return REGISTRY.experts["flashinfer"].why_not(BackendSpec(experts="flashinfer"),
                                                  problem(spec=spec, **kwargs), CUDA)


# The layout.

def test_prepare_weights_swaps_gate_and_up(generator):
    w13_EFH = torch.randn(3, 8, 5, generator=generator)
    w2_EHI = torch.randn(3, 5, 4, generator=generator)
    b13_EF = torch.randn(3, 8, generator=generator)
    prepared = backend.prepare_weights(w13_EFH, w2_EHI, b13_EF, None)
    assert torch.equal(prepared.fc1[:, :4], w13_EFH[:, 4:])  # up rows first
    assert torch.equal(prepared.fc1[:, 4:], w13_EFH[:, :4])  # then the gate rows
    assert prepared.fc1.is_contiguous() and prepared.fc2 is w2_EHI
    assert torch.equal(prepared.fc1_bias, torch.cat([b13_EF[:, 4:], b13_EF[:, :4]], dim=1))
    # FlashInfer takes both biases or neither: zeros stand in for the absent one.
    assert torch.equal(prepared.fc2_bias, torch.zeros(3, 5))
    assert prepared.quant_scales == []
    assert backend.prepare_weights(w13_EFH, w2_EHI, None, None).fc1_bias is None


def test_prepare_weights_swaps_the_block_scales_of_w13(quant_inputs):
    inputs = quant_inputs(FP8_BLOCK, hidden_size=256, intermediate_size=256, num_experts=2)
    prepared = backend.prepare_weights(inputs.w13, inputs.w2, None, None, inputs.w13_scale,
                                       inputs.w2_scale, FP8_BLOCK)
    fc1_scale, fc2_scale = prepared.quant_scales
    assert fc1_scale.shape == (2, 4, 2) and fc2_scale is inputs.w2_scale
    dequantized = quant.dequantize_weights(prepared.fc1, fc1_scale, FP8_BLOCK)
    w13_EFH = inputs.dequantized()[0]
    assert torch.equal(dequantized, torch.cat([w13_EFH[:, 256:], w13_EFH[:, :256]], dim=1))


def test_transposed_weights_are_prepared_contiguous(generator):
    w2_EIH = torch.randn(2, 4, 8, generator=generator)
    prepared = backend.prepare_weights(torch.randn(2, 8, 8, generator=generator),
                                       w2_EIH.transpose(1, 2), None, None)
    assert prepared.fc2.is_contiguous() and torch.equal(prepared.fc2, w2_EIH.transpose(1, 2))


# Both ops against the reference, FlashInfer emulated.

def bf16_inputs(expert_inputs, bias, num_tokens=9):
    inputs = expert_inputs(num_tokens=num_tokens, hidden_size=32, intermediate_size=16,
                           num_experts=4, top_k=2, dtype=torch.bfloat16, bias=bias,
                           skip_fraction=0.25)
    return inputs


@pytest.mark.parametrize("activation", ["silu", "gelu", "swiglu_oai"])
@pytest.mark.parametrize("bias", [False, True])
def test_experts_match_reference(emulated, expert_inputs, activation, bias):
    args = bf16_inputs(expert_inputs, bias).args(activation, 1.702, 0.75)
    out_TH = torch.ops.moe_flashinfer.experts(*args)
    ref_TH = torch.ops.moe_reference.experts(*args)
    assert out_TH.dtype == torch.bfloat16 and out_TH.shape == ref_TH.shape
    assert relative_error(out_TH, ref_TH) < BF16_BOUND
    (call,) = emulated.CALLS
    assert call["activation_type"] == {"gelu": emulated.ActivationType.Geglu}.get(
        activation, emulated.ActivationType.Swiglu)


@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
def test_experts_rows_match_reference(emulated, expert_inputs, activation):
    inputs = bf16_inputs(expert_inputs, bias=True)
    x_RH, expert_R, _, _, count_E, _ = torch.ops.moe.dispatch(
        inputs.hidden_TH, inputs.topk_weights_TK, inputs.topk_ids_TK, 4)
    weights = inputs.args(activation)[3:]
    out_RH = torch.ops.moe_flashinfer.experts_rows(x_RH, expert_R, count_E, *weights)
    ref_RH = torch.ops.moe_reference.experts_rows(x_RH, expert_R, count_E, *weights)
    assert relative_error(out_RH, ref_RH) < BF16_BOUND
    assert torch.equal(out_RH[expert_R < 0], torch.zeros_like(out_RH[expert_R < 0]))


def rows_error(inputs, activation: str) -> float:
    """``experts_rows_quant`` of flashinfer against the reference on the rows a dispatch of
    ``inputs``' tokens gives (4 experts): the relative error."""
    f = inputs.float_inputs
    x_RH, expert_R, _, _, count_E, _ = torch.ops.moe.dispatch(f.hidden_TH, f.topk_weights_TK,
                                                              f.topk_ids_TK, 4)
    rows_args = (x_RH, None, expert_R, count_E, *inputs.weight_args(activation, 1.702, 7.0))
    return relative_error(torch.ops.moe_flashinfer.experts_rows_quant(*rows_args),
                          torch.ops.moe_reference.experts_rows_quant(*rows_args))


@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
def test_fp8_blocks_match_reference(emulated, quant_inputs, activation):
    inputs = quant_inputs(FP8_BLOCK, num_tokens=8, hidden_size=256, intermediate_size=128,
                          num_experts=4, top_k=2, dtype=torch.bfloat16, bias=True,
                          skip_fraction=0.25)
    args = inputs.args(activation, 1.702, 7.0)
    out_TH = torch.ops.moe_flashinfer.experts_quant(*args)
    ref_TH = torch.ops.moe_reference.experts_quant(*args)
    assert relative_error(out_TH, ref_TH) < FP8_BOUND
    assert rows_error(inputs, activation) < FP8_BOUND
    assert all(call["block_scale"] for call in emulated.CALLS)


# mxfp4 (W4A16): widths that are padded (H = 160 -> 256, I = 96 -> 128) and one that is not.
MXFP4_WIDTHS = {"padded": (160, 96), "aligned": (256, 128)}


def mxfp4_inputs(quant_inputs, widths="padded", num_tokens=8, bias=True):
    hidden, inter = MXFP4_WIDTHS[widths]
    return quant_inputs(MXFP4, num_tokens=num_tokens, hidden_size=hidden,
                        intermediate_size=inter, num_experts=4, top_k=2, dtype=torch.bfloat16,
                        bias=bias, skip_fraction=0.25)


def test_prepare_weights_pads_and_interleaves_mxfp4(emulated, quant_inputs):
    """fc1 up rows then gate rows, each half and H padded to 128 with zeros (scale 2**0),
    fc2 padded likewise; both interleaved, their scales folded; biases padded with zeros."""
    inputs = mxfp4_inputs(quant_inputs)
    f = inputs.float_inputs
    prepared = backend.prepare_weights(inputs.w13, inputs.w2, f.b13_EF, f.b2_EH,
                                       inputs.w13_scale, inputs.w2_scale, MXFP4)
    assert (prepared.hidden_size, prepared.padded_hidden) == (160, 256)
    assert prepared.format_kwargs == {"use_w4_group_scaling": True}
    assert prepared.fc1.shape == (4, 256, 128) and prepared.fc2.shape == (4, 256, 64)
    fc1_scale, fc2_scale = prepared.quant_scales
    assert fc1_scale.shape == (4, 4, 2, 16, 4) and fc2_scale.shape == (4, 4, 1, 16, 4)
    assert fc1_scale.dtype == fc2_scale.dtype == torch.int32
    w13_EFH, w2_EHI = inputs.dequantized()
    fc1_EFH = emulated._dequantize_w4(prepared.fc1, fc1_scale)
    fc2_EHI = emulated._dequantize_w4(prepared.fc2, fc2_scale)
    assert torch.equal(fc1_EFH[:, :96, :160], w13_EFH[:, 96:])  # up rows first
    assert torch.equal(fc1_EFH[:, 128:224, :160], w13_EFH[:, :96])  # gate rows at Ip
    assert torch.equal(fc2_EHI[:, :160, :96], w2_EHI)
    padding = [fc1_EFH[:, 96:128], fc1_EFH[:, 224:], fc1_EFH[..., 160:], fc2_EHI[:, 160:],
               fc2_EHI[..., 96:]]
    assert all(not p.any() for p in padding)
    assert torch.equal(prepared.fc1_bias[:, :96], f.b13_EF[:, 96:])
    assert torch.equal(prepared.fc1_bias[:, 128:224], f.b13_EF[:, :96])
    assert not prepared.fc1_bias[:, 96:128].any() and not prepared.fc2_bias[:, 160:].any()
    assert torch.equal(prepared.fc2_bias[:, :160], f.b2_EH)


@pytest.mark.parametrize("widths", list(MXFP4_WIDTHS))
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
def test_mxfp4_matches_reference(emulated, quant_inputs, widths, activation):
    inputs = mxfp4_inputs(quant_inputs, widths)
    args = inputs.args(activation, 1.702, 7.0)
    out_TH = torch.ops.moe_flashinfer.experts_quant(*args)
    ref_TH = torch.ops.moe_reference.experts_quant(*args)
    assert out_TH.shape == ref_TH.shape == (8, MXFP4_WIDTHS[widths][0])
    assert out_TH.is_contiguous() and relative_error(out_TH, ref_TH) < BF16_BOUND
    f = inputs.float_inputs
    assert rows_error(inputs, activation) < BF16_BOUND
    assert all(call["w4"] and not call["block_scale"] for call in emulated.CALLS)
    # Padded widths run padded tokens; aligned ones the caller's own.
    padded_input = emulated.CALLS[0]["input"].shape[1] != f.hidden_TH.shape[1]
    assert padded_input == (widths == "padded")


def test_mxfp4_is_prepared_once_per_version(emulated, quant_inputs, monkeypatch):
    interleaves = []
    real = emulated.interleave_moe_weights_for_sm90_mixed_gemm
    monkeypatch.setattr(emulated.MODULES["flashinfer.fused_moe"],
                        "interleave_moe_weights_for_sm90_mixed_gemm",
                        lambda *a: interleaves.append(1) or real(*a))
    inputs = mxfp4_inputs(quant_inputs)
    args = inputs.args()
    first = torch.ops.moe_flashinfer.experts_quant(*args)
    assert torch.equal(torch.ops.moe_flashinfer.experts_quant(*args), first)
    assert len(interleaves) == 2  # fc1 and fc2, once
    with torch.no_grad():
        inputs.w2_scale.add_(1)  # a scale written in place: prepared again
    changed = torch.ops.moe_flashinfer.experts_quant(*args)
    assert len(interleaves) == 4 and not torch.equal(changed, first)
    assert relative_error(changed, torch.ops.moe_reference.experts_quant(*args)) < BF16_BOUND


@pytest.mark.parametrize("spec", [None, FP8_BLOCK, MXFP4], ids=["bf16", "fp8_block", "mxfp4"])
def test_empty_batch_launches_and_converts_nothing(emulated, expert_inputs, quant_inputs,
                                                   monkeypatch, spec):
    """T = 0 (an idle rank's tokens too): ``[0, H]``, no kernel, no weight conversion."""
    monkeypatch.setattr(backend, "prepare_weights", None)  # a conversion would fail
    if spec is None:
        out_TH = torch.ops.moe_flashinfer.experts(*bf16_inputs(expert_inputs, True, 0).args())
    else:
        inputs = quant_inputs(spec, num_tokens=0, hidden_size=256, intermediate_size=128,
                              dtype=torch.bfloat16, bias=True)
        out_TH = torch.ops.moe_flashinfer.experts_quant(*inputs.args())
    assert out_TH.shape == (0, 32 if spec is None else 256) and out_TH.dtype == torch.bfloat16
    assert emulated.CALLS == [] and len(backend._PREPARED) == 0


def test_received_tokens_are_read_in_place(emulated, expert_inputs):
    """The tokens format's receive buffers (here: views into one workspace-like buffer, at
    offsets) reach FlashInfer's kernel as they are, with no copy."""
    inputs = bf16_inputs(expert_inputs, bias=False)
    workspace = torch.zeros(4096, dtype=torch.uint8)
    num_tokens, hidden = inputs.hidden_TH.shape
    top_k = inputs.topk_ids_TK.shape[1]

    def received(t, offset):
        view = workspace[offset:offset + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        return view

    x_NH = received(inputs.hidden_TH, 128)
    weights_NK = received(inputs.topk_weights_TK.float(), 128 + 1024)
    ids_NK = received(inputs.topk_ids_TK.int(), 128 + 2048)
    out_NH = torch.ops.moe_flashinfer.experts(x_NH, weights_NK, ids_NK,
                                              *inputs.args()[3:])
    (call,) = emulated.CALLS
    assert call["input"].data_ptr() == x_NH.data_ptr()
    assert call["scales"].data_ptr() == weights_NK.data_ptr()
    assert call["ids"].data_ptr() == ids_NK.data_ptr()
    assert (num_tokens, hidden, top_k) == (9, 32, 2)
    assert relative_error(out_NH, torch.ops.moe_reference.experts(*inputs.args())) < BF16_BOUND


def test_rows_arriving_quantized_are_refused(emulated, quant_inputs):
    inputs = quant_inputs(FP8_BLOCK, num_tokens=4, hidden_size=128, intermediate_size=128,
                          dtype=torch.bfloat16)
    f = inputs.float_inputs
    x_RH, expert_R, _, _, count_E, _ = torch.ops.moe.dispatch(f.hidden_TH, f.topk_weights_TK,
                                                              f.topk_ids_TK, 4)
    x_q_RH, x_scale = quant.quantize_activations(x_RH, FP8_BLOCK)
    with pytest.raises(ValueError, match="x_rows must arrive unquantized, in bfloat16"):
        torch.ops.moe_flashinfer.experts_rows_quant(x_q_RH, x_scale, expert_R, count_E,
                                                    *inputs.weight_args(), torch.bfloat16)


def test_direct_calls_outside_supports_raise(expert_inputs, quant_inputs):
    float_args = expert_inputs(num_tokens=3, hidden_size=16, intermediate_size=8).args()
    with pytest.raises(ValueError, match="'flashinfer' runs bfloat16 activations, got "
                                         "torch.float32"):
        torch.ops.moe_flashinfer.experts(*float_args)
    odd_args = expert_inputs(num_tokens=3, hidden_size=12, intermediate_size=8,
                             dtype=torch.bfloat16).args()
    with pytest.raises(ValueError, match="needs hidden_size and intermediate_size divisible "
                                         "by 8 \\(FlashInfer's TMA loads\\), got 12 and 8"):
        torch.ops.moe_flashinfer.experts(*odd_args)
    inputs = quant_inputs(QuantSpec("fp8_channel"), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not run fp8_channel\\+fp8_token"):
        torch.ops.moe_flashinfer.experts_quant(*inputs.args())


# The weight cache.

def test_weights_are_prepared_once_per_version(emulated, expert_inputs, monkeypatch):
    prepared = []
    real = backend.prepare_weights
    monkeypatch.setattr(backend, "prepare_weights", lambda *a: prepared.append(1) or real(*a))
    inputs = bf16_inputs(expert_inputs, bias=True)
    args = inputs.args()
    first = torch.ops.moe_flashinfer.experts(*args)
    assert torch.equal(torch.ops.moe_flashinfer.experts(*args), first) and len(prepared) == 1
    with torch.no_grad():
        inputs.w13_EFH.mul_(2)  # an in-place write bumps the version: prepared again
    changed = torch.ops.moe_flashinfer.experts(*args)
    assert len(prepared) == 2 and not torch.equal(changed, first)
    assert relative_error(changed, torch.ops.moe_reference.experts(*args)) < BF16_BOUND
    assert len(backend._PREPARED) == 1


def _layer(expert_inputs, quant_inputs, spec, bias):
    """``(name of the op, args, prepare_weights' arguments)`` of one small layer in
    ``spec``."""
    if spec is None:
        inputs = bf16_inputs(expert_inputs, bias)
        return ("experts", inputs.args(),
                (inputs.w13_EFH, inputs.w2_EHI, inputs.b13_EF, inputs.b2_EH))
    inputs = (mxfp4_inputs(quant_inputs, bias=bias) if spec is MXFP4 else
              quant_inputs(spec, num_tokens=9, hidden_size=256, intermediate_size=128,
                           dtype=torch.bfloat16, bias=bias))
    f = inputs.float_inputs
    return ("experts_quant", inputs.args(),
            (inputs.w13, inputs.w2, f.b13_EF, f.b2_EH, inputs.w13_scale, inputs.w2_scale))


@pytest.mark.parametrize("spec", [None, FP8_BLOCK, MXFP4], ids=["bf16", "fp8_block", "mxfp4"])
@pytest.mark.parametrize("biases", ["none", "b13", "b2", "both"])
def test_copy_bytes_counts_what_prepare_allocates(emulated, expert_inputs, quant_inputs, spec,
                                                  biases):
    *_, sources = _layer(expert_inputs, quant_inputs, spec, biases != "none")
    # One bias given: prepare_weights makes zeros for the other.
    b13, b2 = (sources[2] if biases in ("b13", "both") else None,
               sources[3] if biases in ("b2", "both") else None)
    sources = (*sources[:2], b13, b2, *sources[4:])
    prepared = backend.prepare_weights(*sources, spec=spec)
    held = {t.untyped_storage().data_ptr() for t in sources if t is not None}
    made = [t for t in (prepared.fc1, prepared.fc2, prepared.fc1_bias, prepared.fc2_bias,
                        *prepared.quant_scales)
            if t is not None and t.untyped_storage().data_ptr() not in held]
    made_bytes = sum(t.numel() * t.element_size() for t in made)
    counted = backend.copy_bytes(*sources, spec=spec)
    if spec is MXFP4:  # the padded matrices and scales live beside their interleaved copies
        biases = [t for t in (prepared.fc1_bias, prepared.fc2_bias) if t is not None]
        made_bytes = 2 * made_bytes - sum(t.numel() * t.element_size() for t in biases)
    assert counted == made_bytes


@pytest.mark.parametrize("spec", [None, FP8_BLOCK, MXFP4], ids=["bf16", "fp8_block", "mxfp4"])
def test_a_copy_without_memory_to_spare_is_refused_before_allocating(
        emulated, expert_inputs, quant_inputs, monkeypatch, spec):
    name, args, sources = _layer(expert_inputs, quant_inputs, spec, bias=True)
    op = getattr(torch.ops.moe_flashinfer, name)
    needed = backend.copy_bytes(*sources, spec=spec)
    monkeypatch.setattr(backend, "spare_bytes", lambda device: needed - 1)
    real = backend.prepare_weights
    monkeypatch.setattr(backend, "prepare_weights", None)  # a conversion would fail
    with pytest.raises(torch.OutOfMemoryError,
                       match=(f"experts backend 'flashinfer' converts each layer's weights once"
                              f".*this layer's takes {needed / 2**30:.2f} GiB.*has 0.00 GiB to "
                              "spare.*6.25% of its memory free.*experts='triton'")):
        op(*args)
    assert len(backend._PREPARED) == 0 and emulated.CALLS == []
    monkeypatch.setattr(backend, "spare_bytes", lambda device: needed)
    monkeypatch.setattr(backend, "prepare_weights", real)
    assert relative_error(op(*args), getattr(torch.ops.moe_reference, name)(*args)) < (
        FP8_BOUND if spec is FP8_BLOCK else BF16_BOUND)


@pytest.mark.parametrize("freed_first", ["w13", "w2"])
def test_cache_entries_go_with_their_weights(emulated, expert_inputs, freed_first):
    """An entry goes when its weights go, and holds none of them alive (it holds
    w2 itself, as fc2)."""
    inputs = bf16_inputs(expert_inputs, bias=True)
    torch.ops.moe_flashinfer.experts(*inputs.args())
    assert len(backend._PREPARED) == 1
    storages = [weakref.ref(t.untyped_storage())
                for t in (inputs.w13_EFH, inputs.w2_EHI, inputs.b13_EF, inputs.b2_EH)]
    if freed_first == "w13":
        inputs.w13_EFH = None
        gc.collect()
        assert len(backend._PREPARED) == 0
    del inputs
    gc.collect()
    assert len(backend._PREPARED) == 0 and all(ref() is None for ref in storages)


def test_each_layer_shape_is_profiled_once_then_runs_tuned(emulated, expert_inputs):
    """The first call of a shape runs once more under FlashInfer's autotuner, into an output
    of its own; later calls of that shape (another layer, another token count) do not; a
    new shape does. Every call passes the same ``tune_max_num_tokens``, which its buckets
    depend on."""
    for num_tokens in (9, 5):
        torch.ops.moe_flashinfer.experts(*bf16_inputs(expert_inputs, False, num_tokens).args())
    assert len(emulated.PROFILED) == 1 and len(emulated.CALLS) == 2
    (profiled,) = emulated.PROFILED
    assert profiled["output"].data_ptr() != emulated.CALLS[0]["output"].data_ptr()
    assert torch.equal(profiled["output"], emulated.CALLS[0]["output"])
    wider = expert_inputs(num_tokens=3, hidden_size=64, intermediate_size=16, num_experts=4,
                          top_k=2, dtype=torch.bfloat16)
    torch.ops.moe_flashinfer.experts(*wider.args())
    assert len(emulated.PROFILED) == 2
    assert all(call["options"]["tune_max_num_tokens"] == tuning.TUNE_MAX_TOKENS
               for call in emulated.CALLS + emulated.PROFILED)


def test_tune_cache_names_flashinfers_file(emulated, expert_inputs, monkeypatch, tmp_path):
    """Without the variable FlashInfer's autotuner keeps its tactics in the process only;
    with it, it reads and writes the file named."""
    torch.ops.moe_flashinfer.experts(*bf16_inputs(expert_inputs, bias=False).args())
    assert emulated.TUNE_OPTIONS == [{"cache": None}]
    tuning.forget_tuned_shapes()
    monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path / "tactics.json"))
    torch.ops.moe_flashinfer.experts(*bf16_inputs(expert_inputs, bias=False).args())
    assert emulated.TUNE_OPTIONS[1] == {"cache": str(tmp_path / "tactics.json")}


def test_autotune_off_profiles_nothing(emulated, expert_inputs, monkeypatch):
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    out_TH = torch.ops.moe_flashinfer.experts(*bf16_inputs(expert_inputs, bias=False).args())
    assert emulated.PROFILED == [] and len(emulated.CALLS) == 1 and out_TH.isfinite().all()


def test_a_shape_first_seen_during_capture_runs_untuned(emulated, expert_inputs, monkeypatch):
    args = bf16_inputs(expert_inputs, bias=False).args()
    torch.ops.moe_flashinfer.experts(*args)
    tuning.forget_tuned_shapes()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    torch.ops.moe_flashinfer.experts(*args)
    assert len(emulated.PROFILED) == 1 and len(emulated.CALLS) == 2


def test_a_miss_during_cuda_graph_capture_raises(emulated, expert_inputs, monkeypatch):
    args = bf16_inputs(expert_inputs, bias=False).args()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="run the layer once before capturing"):
        torch.ops.moe_flashinfer.experts(*args)


# supports.

def test_supports_without_flashinfer(gpu, monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer fails
    library.missing.cache_clear()
    try:
        assert reason().startswith("import flashinfer failed") or reason() == (
            "flashinfer-python is not installed (pip install flashinfer-python)")
    finally:
        library.missing.cache_clear()


def test_supports_off_a_gpu():
    table = {s.name: s for s in tmo.available_backends("cpu") if s.kind == "experts"}
    assert not table["flashinfer"].available
    assert table["flashinfer"].reason == "needs a CUDA device, got cpu"


def test_supports_says_how_to_build_the_module(emulated, gpu):
    assert reason() == (f"the SM90 fused-MoE module ({MODULE}) is not built, and building it "
                        f"takes long ({cutlass_module.BUILD_TIME}), so no call builds it "
                        f"implicitly: {BUILD_HINT}")
    assert emulated.BUILDS == []


def test_supports_once_built_or_opted_in(emulated, gpu, monkeypatch):
    monkeypatch.setenv(cutlass_module.BUILD_ENV, "1")
    assert reason() is None
    monkeypatch.delenv(cutlass_module.BUILD_ENV)
    emulated.AOT_ARTIFACTS[MODULE] = AOT_PATH
    assert reason() is None and cutlass_module.built_path() == AOT_PATH
    assert emulated.BUILDS == []


NOT_BF16 = "runs bfloat16 activations (FlashInfer's bf16 kernels), got torch.float16"
NOT_SM90 = "runs FlashInfer's SM90 fused-MoE module, on sm90 (Hopper) only here, got sm100"
NO_ACTIVATION = "has no FlashInfer activation for 'relu2' (it maps silu, gelu, swiglu_oai)"
NOT_ALIGNED = ("needs hidden_size and intermediate_size divisible by 8 (FlashInfer's TMA "
               "loads), got 4100 and 1024")
WHY_NOT = {  # id: (what differs from sm90, bf16, silu, H=4096, I=1024, float weights), reason
    "sm89": ({"sm": (8, 9)}, "needs sm90 or newer, got sm89"),
    "sm100": ({"sm": (10, 0)}, NOT_SM90),
    "fp16": ({"dtype": torch.float16}, NOT_BF16),
    "activation": ({"activation": "relu2"}, NO_ACTIVATION),
    "H": ({"hidden": 4100}, NOT_ALIGNED),
    "mxfp4 I": ({"inter": 1000, "spec": MXFP4}, (
        "needs hidden_size and intermediate_size divisible by 32 (one e8m0 scale per 32 "
        "columns; FlashInfer's mixed-input GEMM then runs them padded to multiples of 128), "
        "got 4096 and 1000")),
}


@pytest.mark.parametrize("case", list(WHY_NOT))
def test_supports_says_why_not(built, gpu, case):
    changes, expected = WHY_NOT[case]
    gpu(*changes.pop("sm", (9, 0)))
    assert reason(**changes) == expected


FORMAT_REASONS = {  # spec: what supports says on a built sm90 GPU
    FP8_BLOCK: None,
    QuantSpec("fp8_block", block_size=(64, 64)): (
        "does not run fp8_block64x64+fp8_group: FlashInfer's block-scaled path takes "
        "128 x 128 weight blocks only"),
    QuantSpec("fp8_block", "none"): (
        "does not run fp8_block128x128+none (weight-only fp8): FlashInfer's block-scaled path "
        "quantizes the activations too, in 1 x 128 groups"),
    QuantSpec("fp8_tensor"): (
        "does not run fp8_tensor+fp8_token: FlashInfer's per-tensor fp8 path takes activations "
        "quantized beforehand with one static scale, not fp8_token scales computed per row, "
        "and one weight scale per expert"),
    QuantSpec("fp8_channel", "none"): (
        "does not run fp8_channel+none: FlashInfer has no weight-only fp8 path"),
    MXFP4: None,
}


@pytest.mark.parametrize("spec", list(FORMAT_REASONS), ids=lambda spec: spec.name)
def test_supports_says_which_formats_run(built, gpu, spec):
    assert reason(spec=spec) == FORMAT_REASONS[spec]


def test_available_backends_lists_it_with_its_formats(built, gpu):
    row = {(s.kind, s.name): s for s in tmo.available_backends("cuda")}[("experts", "flashinfer")]
    assert row.available and row.backward == "reference"
    assert row.quantized == "fp8_block,mxfp4"


# Building: only on purpose.

def test_nothing_builds_the_module_but_build(tmp_path):
    """Importing the package, `available_backends()` and choosing backends (by name
    too) on an sm90 GPU whose module is not built: no build, the reason says how."""
    script = f"""
import sys
sys.path.insert(0, {str(ROOT / 'tests')!r})
import flashinfer_emulator
flashinfer_emulator.install({str(tmp_path)!r})
import torch
torch.cuda.is_available = lambda: True
torch.cuda.get_device_capability = lambda device=None: (9, 0)
torch.cuda.current_device = lambda: 0
import torch_moe_ops as tmo
from torch_moe_ops.backends.registry import REGISTRY, Problem
rows = {{s.name: s for s in tmo.available_backends("cuda") if s.kind == "experts"}}
assert not rows["flashinfer"].available and "is not built" in rows["flashinfer"].reason
try:
    REGISTRY.choose_experts(tmo.BackendSpec(experts="flashinfer"), Problem(torch.bfloat16),
                            torch.device("cuda"))
except ValueError as error:
    assert "is not built" in str(error), error
else:
    raise AssertionError("chose a backend whose module is not built")
assert flashinfer_emulator.BUILDS == [], flashinfer_emulator.BUILDS
"""
    env = {k: v for k, v in os.environ.items() if k != cutlass_module.BUILD_ENV}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_build_builds_once_and_reports_progress(emulated, gpu):
    state = cutlass_module.progress()
    assert state.objects_total == 0 and "no build started" in str(state)
    build_dir = emulated.jit_env.FLASHINFER_JIT_DIR / "torch_moe_ops_fused_moe_90"
    build_dir.mkdir(parents=True)
    objects = [build_dir / f"object{i}.cuda.o" for i in range(3)]
    (build_dir / "build.ninja").write_text("".join(
        f"build {path}: cuda_compile /src/{path.stem}.cu\n" for path in objects)
        + f"build {build_dir / (MODULE + '.so')}: link {' '.join(map(str, objects))}\n")
    objects[0].write_bytes(b"")
    assert str(cutlass_module.progress()) == (
        f"torch_moe_ops_fused_moe_90: not built yet, 1 of 3 objects compiled in {build_dir}")
    path = tmo.backends.flashinfer.build(verbose=False)
    assert path == build_dir / f"{MODULE}.so" and emulated.BUILDS == [MODULE]
    assert str(cutlass_module.progress()) == f"torch_moe_ops_fused_moe_90: built, {path}"
    assert reason() is None


def test_build_leaves_an_installed_module_alone(emulated):
    emulated.AOT_ARTIFACTS[MODULE] = AOT_PATH
    assert cutlass_module.build() == AOT_PATH and emulated.BUILDS == []


RUNNERS = "tensorrt_llm::kernels::cutlass_kernels::MoeGemmRunner"
DROPPED_SYMBOLS = [  # as nm prints them demangled: a dropped pair's runner, C++'s, CUDA's
    f"{RUNNERS}<__nv_fp8_e4m3, cutlass::integer_subbyte<4, false>, half, half>::moeGemm()",
    f"{RUNNERS}<half, half, half, half>::getConfigs() const",
    "operator delete(void*)@GLIBCXX_3.4", "cudaLaunchKernelExC@libcudart.so.13"]
KEPT_SYMBOL = f"{RUNNERS}<__nv_bfloat16, cutlass::float_e2m1_t, __nv_bfloat16>::moeGemm()"
OTHER_SYMBOL = "tensorrt_llm::kernels::cutlass_kernels_oss::sm90_launcher<float>(int)"


def test_symbols_of_dropped_runners_are_expected_and_others_not():
    report = cutlass_symbols.classify(Path("/m.so"), DROPPED_SYMBOLS)
    assert report.ok and report.dropped == {
        "__nv_fp8_e4m3 x cutlass::integer_subbyte<4, false>": 1, "half x half": 1}
    report = cutlass_symbols.classify(Path("/m.so"), [*DROPPED_SYMBOLS, KEPT_SYMBOL,
                                                      OTHER_SYMBOL])
    assert not report.ok and report.kept == [KEPT_SYMBOL] and report.unexpected == [OTHER_SYMBOL]
    assert "1 of the kept pairs' runners, 1 others" in str(report)


def test_a_module_missing_a_called_runner_fails_before_its_first_call(built, expert_inputs,
                                                                     monkeypatch):
    undefined = [*DROPPED_SYMBOLS, OTHER_SYMBOL]
    monkeypatch.setattr(cutlass_symbols, "undefined_symbols", lambda library: undefined)
    args = bf16_inputs(expert_inputs, bias=False).args()
    torch.ops.moe_flashinfer.experts(*args)  # dropped runners' symbols: expected
    cutlass_module.check_symbols.cache_clear()
    undefined.append(KEPT_SYMBOL)
    with pytest.raises(RuntimeError, match="cannot run the kernels the flashinfer experts "
                                           "backend calls(.|\n)*Rebuild it with"):
        torch.ops.moe_flashinfer.experts(*args)
    assert len(built.CALLS) == 1


def test_command_line(emulated, capsys, monkeypatch):
    undefined = list(DROPPED_SYMBOLS)
    monkeypatch.setattr(cutlass_symbols, "undefined_symbols", lambda library: undefined)
    assert cutlass_module.main(["status"]) == 3
    assert "torch_moe_ops_fused_moe_90: not built" in capsys.readouterr().out
    assert cutlass_module.main(["build"]) == 0 and emulated.BUILDS == ["torch_moe_ops_fused_moe_90"]
    assert "2 of dropped pairs' runners" in capsys.readouterr().out
    assert cutlass_module.main(["status"]) == 0
    undefined.append(KEPT_SYMBOL)  # a runner the backend calls, unresolved: status says so
    assert cutlass_module.main(["status"]) == 4
    assert KEPT_SYMBOL in capsys.readouterr().out
    assert cutlass_module.main([]) == 2 and "usage:" in capsys.readouterr().err
    assert cutlass_module.main(["--help"]) == 0 and "usage:" in capsys.readouterr().out


def test_build_without_flashinfer_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    library.missing.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="cannot build FlashInfer's fused-MoE module"):
            cutlass_module.build()
    finally:
        library.missing.cache_clear()


# The registry.

def test_registry_row():
    flashinfer, others = REGISTRY.experts["flashinfer"], REGISTRY.experts
    assert flashinfer.namespace == "moe_flashinfer" and flashinfer.formats == (TOKENS, ROWS)
    assert flashinfer.priority < min(others["triton"].priority, others["grouped_mm"].priority)
    assert flashinfer.backward is None and flashinfer.quantized_rows == ()
    with pytest.raises(ValueError, match="experts backend 'flashinfer' is not available: "
                                         "needs a CUDA device, got cpu"):
        REGISTRY.choose_experts(BackendSpec(experts="flashinfer"), Problem(torch.float32), CPU)


@pytest.mark.parametrize("a2a", ["all_to_all", "deepep"])
def test_fp8_block_layers_dispatch_in_bf16(a2a, recwarn):
    """FlashInfer quantizes its rows itself: an fp8_block layer's rows travel in bf16,
    from an a2a backend that could send fp8 too, without a warning; asking for fp8
    falls back to bf16 with one."""
    sides = DispatchSides.of(REGISTRY.a2a[a2a], REGISTRY.experts["flashinfer"])
    chosen = resolve_dispatch_dtype(torch.bfloat16, None, FP8_BLOCK, sides)
    assert (chosen.dtype, chosen.rule) == (torch.bfloat16, DEFAULT_RULE) and not recwarn
    with pytest.warns(UserWarning, match="dispatching in torch.bfloat16"):
        chosen = resolve_dispatch_dtype(torch.bfloat16, torch.float8_e4m3fn, FP8_BLOCK, sides)
    assert chosen.dtype == torch.bfloat16


@pytest.mark.parametrize("spec", [None, FP8_BLOCK, MXFP4], ids=["bf16", "fp8_block", "mxfp4"])
@pytest.mark.parametrize("a2a", ["flashinfer", "all_to_all", "deepep"])
def test_expert_parallel_layers_take_the_tokens_format(monkeypatch, a2a, spec):
    """Its experts read bf16 tokens (they quantize inside): a layer of any of its formats
    takes the tokens format, whose receive buffers its ``experts``/``experts_quant`` read in
    place, from FlashInfer's all-to-all as from the others."""
    from torch_moe_ops.lowering.plan import plan_layer

    for table, name in ((REGISTRY.a2a, a2a), (REGISTRY.experts, "flashinfer")):
        monkeypatch.setitem(table, name, dataclasses.replace(table[name],
                                                             supports=lambda *_: None))
    layer = Problem(torch.bfloat16, num_experts=64, num_local_experts=32, hidden_size=2048,
                    intermediate_size=768, top_k=8, ep_size=2, max_tokens_per_rank=64,
                    training=False, quant=spec)
    plan = plan_layer(BackendSpec(experts="flashinfer", a2a=a2a), layer, CPU)
    assert plan.format.name == "tokens", plan.format_reason


# On an sm90 GPU with FlashInfer's module built.

def _needs_flashinfer(spec=None):
    why = REGISTRY.experts["flashinfer"].why_not(
        BackendSpec(experts="flashinfer"), Problem(torch.bfloat16, quant=spec), CUDA)
    if why is not None:
        pytest.skip(f"experts backend 'flashinfer': {why}")


# The widths of benchmarks/bench_experts.py's five shapes: (H, I, K, activation, bias), with
# at most `GPU_EXPERTS` experts (the reference computes every expert for every token).
GPU_WIDTHS = {
    "mixtral-8x7b": (4096, 14336, 2, "silu", False),
    "qwen3-30b-a3b": (2048, 768, 8, "silu", False),
    "olmoe": (2048, 1024, 8, "silu", False),
    "gpt-oss-20b": (2880, 2880, 4, "swiglu_oai", True),
    "deepseek-v3": (7168, 2048, 8, "silu", False),
}
GPU_EXPERTS = {"mixtral-8x7b": 8}
DEFAULT_GPU_EXPERTS = 16
GPU_TOKENS = (0, 1, 7, 256)
# T = 4096 at a few widths only: the whole file's GPU run stays within a few minutes.
LARGE_TOKENS = 4096
LARGE_WIDTHS = ("qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v3")
GPU_FORMATS = {"bf16": None, "fp8_block": FP8_BLOCK, "mxfp4": MXFP4}
BOUNDS = {"bf16": BF16_BOUND, "fp8_block": FP8_BOUND, "mxfp4": BF16_BOUND}


def gpu_route(generator, num_tokens, num_experts, top_k):
    """Routing of ``num_tokens``: every fifth slot -1 (and with 2+ tokens, all of the last
    token's), expert 0 chosen by none."""
    logits_TE = torch.randn(num_tokens, num_experts, device="cuda", generator=generator)
    logits_TE[:, 0] = -math.inf
    weights_TK, ids_TK = torch.ops.moe.route(logits_TE, None, top_k, "softmax", True, 1, 1, 1.0)
    ids_TK.view(-1)[::5] = -1
    if num_tokens > 1:
        ids_TK[-1] = -1
    return weights_TK, ids_TK


@dataclasses.dataclass
class GpuLayer:
    """One layer's experts on the GPU in one format: ``weights`` are the experts op's
    arguments after the routing (``experts`` for bf16, ``experts_quant`` otherwise)."""

    hidden: int
    num_experts: int
    top_k: int
    quantized: bool
    weights: tuple

    def ops(self, namespace: str):
        ops = getattr(torch.ops, namespace)
        return (ops.experts_quant, ops.experts_rows_quant) if self.quantized else (
            ops.experts, ops.experts_rows)

    def rows_scale(self) -> tuple:
        """``experts_rows_quant``'s ``x_scale`` (rows arrive in bf16), or nothing."""
        return (None,) if self.quantized else ()


def gpu_layer(width: str, fmt: str, generator) -> GpuLayer:
    hidden, inter, top_k, act, bias = GPU_WIDTHS[width]
    num_experts = GPU_EXPERTS.get(width, DEFAULT_GPU_EXPERTS)

    def randn(*size, scale=1.0):
        return torch.randn(*size, device="cuda", generator=generator) * scale

    w13_EFH = randn(num_experts, 2 * inter, hidden, scale=hidden ** -0.5)
    w2_EHI = randn(num_experts, hidden, inter, scale=inter ** -0.5)
    biases = ((randn(num_experts, 2 * inter, scale=0.5).bfloat16(),
               randn(num_experts, hidden, scale=0.5).bfloat16()) if bias else (None, None))
    static = (act, 1.702, 7.0)
    spec = GPU_FORMATS[fmt]
    if spec is None:
        weights = (w13_EFH.bfloat16(), w2_EHI.bfloat16(), *biases, *static)
    else:
        w13, w13_scale = quant.quantize_weights(w13_EFH, spec)
        w2, w2_scale = quant.quantize_weights(w2_EHI, spec)
        weights = (w13, w2, w13_scale, w2_scale, *biases, spec.weights, spec.activations,
                   spec.block_list, *static)
    return GpuLayer(hidden, num_experts, top_k, spec is not None, weights)


def _format_widths():
    """(format, width) pairs that the format can hold (fp8 blocks: H and I in 128s)."""
    for fmt, spec in GPU_FORMATS.items():
        for width, (hidden, inter, *_) in GPU_WIDTHS.items():
            if spec is None or not (spec.weights == "fp8_block" and (hidden % 128 or inter % 128)):
                yield pytest.param(fmt, width, id=f"{fmt}-{width}")


@pytest.mark.gpu
@pytest.mark.parametrize(("fmt", "width"), list(_format_widths()))
def test_gpu_matches_reference(fmt, width, poisoned_empty, monkeypatch):
    """Both ops against the reference at T = 0, 1, 7, 256 (and 4096 at some widths), with
    skipped slots: ``[0, H]`` for T = 0, rows of skipped slots all zeros. On FlashInfer's
    fallback tactics: profiling each of these 14 shapes would add minutes, and the tuned
    path runs in the compiled tests below."""
    _needs_flashinfer(GPU_FORMATS[fmt])
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    generator = torch.Generator(device="cuda").manual_seed(0)
    layer = gpu_layer(width, fmt, generator)
    experts_op, rows_op = layer.ops("moe_flashinfer")
    ref_op, ref_rows_op = layer.ops("moe_reference")
    tokens = GPU_TOKENS + ((LARGE_TOKENS,) if width in LARGE_WIDTHS else ())
    for num_tokens in tokens:
        hidden_TH = torch.randn(num_tokens, layer.hidden, device="cuda",
                                generator=generator).bfloat16()
        weights_TK, ids_TK = gpu_route(generator, num_tokens, layer.num_experts, layer.top_k)
        args = (hidden_TH, weights_TK, ids_TK, *layer.weights)
        out_TH = experts_op(*args)
        assert out_TH.shape == (num_tokens, layer.hidden) and out_TH.dtype == torch.bfloat16
        if num_tokens == 0:
            continue
        assert not out_TH.isnan().any(), num_tokens
        error = relative_error(out_TH, ref_op(*args))
        assert error < BOUNDS[fmt], (num_tokens, error)
        if num_tokens > 1:
            assert not out_TH[-1].any(), num_tokens  # every slot skipped: nothing added
        if num_tokens in (7, 256):
            x_RH, expert_R, _, _, count_E, _ = torch.ops.moe.dispatch(
                hidden_TH, weights_TK, ids_TK, layer.num_experts)
            rows_args = (x_RH, *layer.rows_scale(), expert_R, count_E, *layer.weights)
            out_RH = rows_op(*rows_args)
            assert torch.equal(out_RH[expert_R < 0], torch.zeros_like(out_RH[expert_R < 0]))
            assert relative_error(out_RH, ref_rows_op(*rows_args)) < BOUNDS[fmt], num_tokens


# One width per format for capture and compilation: GPT-OSS's for mxfp4 (padded H).
CAPTURE_WIDTHS = {"bf16": "qwen3-30b-a3b", "fp8_block": "deepseek-v3", "mxfp4": "gpt-oss-20b"}


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(GPU_FORMATS))
def test_gpu_captures_in_cuda_graph(fmt, monkeypatch):
    """After a first call (which converts the weights), the op captures in a CUDA graph and
    replays on new tokens and routing. Untuned: profiling these model widths took 17-107 s
    on an H200; the compiled tests below capture the tuned path (reduce-overhead)."""
    _needs_flashinfer(GPU_FORMATS[fmt])
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    generator = torch.Generator(device="cuda").manual_seed(0)
    layer = gpu_layer(CAPTURE_WIDTHS[fmt], fmt, generator)
    experts_op, _ = layer.ops("moe_flashinfer")
    ref_op, _ = layer.ops("moe_reference")

    def problem():
        hidden_TH = torch.randn(64, layer.hidden, device="cuda", generator=generator).bfloat16()
        return (hidden_TH, *gpu_route(generator, 64, layer.num_experts, layer.top_k))

    inputs = problem()
    experts_op(*inputs, *layer.weights)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_TH = experts_op(*inputs, *layer.weights)
    fresh = problem()
    for tensor, new in zip(inputs, fresh):
        tensor.copy_(new)
    out_TH.fill_(math.nan)
    graph.replay()
    assert relative_error(out_TH, ref_op(*fresh, *layer.weights)) < BOUNDS[fmt]


COMPILED_CONFIGS = {  # a small layer of each format's model family
    "bf16": dict(hidden_size=2048, intermediate_size=768, num_experts=16, top_k=8,
                 renormalize=True),
    "fp8_block": dict(hidden_size=2048, intermediate_size=768, num_experts=16, top_k=8,
                      scoring="sigmoid", renormalize=True, quant=FP8_BLOCK),
    "mxfp4": dict(hidden_size=2880, intermediate_size=2880, num_experts=16, top_k=4,
                  scoring="topk_softmax", activation="swiglu_oai", expert_bias=True,
                  quant=MXFP4),
}


@pytest.mark.gpu
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["inductor", "cuda-graphs"])
@pytest.mark.parametrize("fmt", list(GPU_FORMATS))
def test_gpu_compiled_moe_runs_flashinfer(fmt, mode, monkeypatch):
    """``tmo.backend(experts="flashinfer")``: one graph (fullgraph) whose experts op is
    FlashInfer's, against the reference backend's graph of the same module; with
    ``mode="reduce-overhead"`` replayed as CUDA graphs on new tokens. Tuned in bf16 and
    fp8 (the first call profiles, outside the graphs' pools); MXFP4 on the fallback
    tactics, since profiling this layer took 129 s on an H100 (its tuned tactics are
    checked against the reference by bench_experts.py's error column)."""
    _needs_flashinfer(GPU_FORMATS[fmt])
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0" if fmt == "mxfp4" else "1")
    from torch._inductor.utils import run_and_get_code

    cfg = tmo.MoEConfig(**COMPILED_CONFIGS[fmt])
    torch.manual_seed(0)
    moe = tmo.MoE(cfg, device="cuda", dtype=torch.bfloat16)
    expected = torch.compile(moe, backend=tmo.backend(experts="reference"), fullgraph=True)
    compiled = torch.compile(moe, backend=tmo.backend(experts="flashinfer", mode=mode),
                             fullgraph=True)
    with torch.no_grad():
        for step in range(3 if mode else 1):
            x_TH = torch.randn(256, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
            ref_TH = expected(x_TH)
            if step == 0:
                out_TH, codes = run_and_get_code(compiled, x_TH)
                assert "moe_flashinfer.experts" in "\n".join(codes)
            else:
                out_TH = compiled(x_TH).clone()
            assert relative_error(out_TH, ref_TH) < BOUNDS[fmt], step
