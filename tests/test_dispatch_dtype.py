"""The dispatch dtype rule: explicit > quantization spec > experts backend > hardware
default, one warning on a fallback, and no process state (two layers may resolve
differently). fp8 only where both sides take it: the a2a backend sends fp8 rows and
the experts read them; an experts backend that quantizes inside gets bf16."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from torch_moe_ops.backends.dispatch_dtype import (
    DEFAULT_RULE,
    DispatchDtype,
    DispatchSides,
    resolve_dispatch_dtype,
)
from torch_moe_ops.backends.registry import REGISTRY
from torch_moe_ops.config import QuantSpec

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
W8A8_TOKEN = QuantSpec("fp8_channel")
W8A8_GROUP = QuantSpec("fp8_block")
W8A16 = QuantSpec("fp8_block", "none")
# An a2a that sends fp8 rows, and experts that read them or quantize inside.
READS_FP8 = DispatchSides("a2a backend 'a'", True, "experts backend 'r'", None,
                          ("fp8_token", "fp8_group"))
QUANTIZES_INSIDE = DispatchSides("a2a backend 'a'", True, "experts backend 'q'")
SENDS_NO_FP8 = DispatchSides("a2a backend 'n'", False, "experts backend 'r'", None,
                             ("fp8_token", "fp8_group"))


def _no_warning(*args, **kwargs) -> DispatchDtype:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return resolve_dispatch_dtype(BF16, *args, **kwargs)


def _one_warning(*args, **kwargs) -> tuple[DispatchDtype, str]:
    with pytest.warns(UserWarning) as caught:
        chosen = resolve_dispatch_dtype(BF16, *args, **kwargs)
    assert len(caught) == 1
    return chosen, str(caught[0].message)


def test_default_is_the_activation_dtype():
    assert _no_warning() == DispatchDtype(BF16, DEFAULT_RULE)
    assert resolve_dispatch_dtype(torch.float32) == DispatchDtype(torch.float32, DEFAULT_RULE)


def test_explicit_argument_comes_first():
    sides = DispatchSides(experts_dtype=BF16)
    assert _no_warning(explicit=BF16, sides=sides) == DispatchDtype(
        BF16, "dispatch_dtype argument")


def test_experts_backend_before_the_default():
    sides = DispatchSides(experts_name="experts backend 'x'", experts_dtype=BF16)
    assert _no_warning(sides=sides) == DispatchDtype(BF16, "experts backend 'x'")


@pytest.mark.parametrize("spec", [W8A8_TOKEN, W8A8_GROUP], ids=lambda s: s.activations)
def test_fp8_activations_travel_in_fp8_where_the_experts_read_them(spec):
    assert _no_warning(quant=spec, sides=READS_FP8) == DispatchDtype(
        FP8, f"quantization spec {spec.name}")


@pytest.mark.parametrize("sides", [QUANTIZES_INSIDE, SENDS_NO_FP8],
                         ids=["experts_quantize_inside", "a2a_sends_no_fp8"])
def test_fp8_activations_travel_unquantized_where_a_side_cannot_take_fp8(sides):
    # Not a fallback: the experts quantize each row themselves, to the same values.
    assert _no_warning(quant=W8A8_GROUP, sides=sides) == DispatchDtype(BF16, DEFAULT_RULE)


def test_experts_reading_one_fp8_format_get_the_other_unquantized():
    sides = DispatchSides("a2a backend 'a'", True, "experts backend 'r'", None, ("fp8_token",))
    assert _no_warning(quant=W8A8_TOKEN, sides=sides).dtype == FP8
    assert _no_warning(quant=W8A8_GROUP, sides=sides).dtype == BF16


def test_weight_only_layers_travel_unquantized():
    assert _no_warning(quant=W8A16, sides=READS_FP8) == DispatchDtype(BF16, DEFAULT_RULE)


def test_explicit_activation_dtype_is_honored_on_an_fp8_layer():
    assert _no_warning(explicit=BF16, quant=W8A8_TOKEN, sides=READS_FP8) == DispatchDtype(
        BF16, "dispatch_dtype argument")


def test_explicit_fp8_is_honored_where_both_sides_take_it():
    assert _no_warning(explicit=FP8, quant=W8A8_GROUP, sides=READS_FP8) == DispatchDtype(
        FP8, "dispatch_dtype argument")


@pytest.mark.parametrize("quant, sides, reason", [
    (None, READS_FP8, "the layer's activations are not quantized to fp8 (quant=None)"),
    (W8A16, READS_FP8, ("the layer's activations are not quantized to fp8 "
                        "(quant=fp8_block128x128+none)")),
    (W8A8_TOKEN, QUANTIZES_INSIDE, ("experts backend 'q' quantizes its rows itself "
                                    "(reads no fp8_token rows)")),
    (W8A8_TOKEN, SENDS_NO_FP8, "a2a backend 'n' cannot send fp8 rows"),
], ids=["unquantized", "weight_only", "experts_quantize_inside", "a2a_sends_no_fp8"])
def test_impossible_explicit_fp8_falls_back_with_one_warning_naming_both(quant, sides, reason):
    chosen, message = _one_warning(explicit=FP8, quant=quant, sides=sides)
    assert chosen == DispatchDtype(BF16, DEFAULT_RULE)
    assert "torch.float8_e4m3fn (dispatch_dtype argument)" in message
    assert f"torch.bfloat16 ({DEFAULT_RULE})" in message
    assert reason in message


def test_impossible_explicit_conversion_falls_back_to_fp8_of_the_spec():
    chosen, message = _one_warning(explicit=torch.float16, quant=W8A8_TOKEN, sides=READS_FP8)
    assert chosen == DispatchDtype(FP8, f"quantization spec {W8A8_TOKEN.name}")
    assert "no dispatch kernel converts torch.bfloat16 activations to torch.float16" in message


def test_experts_backend_reading_what_no_kernel_makes_raises():
    sides = DispatchSides(experts_name="experts backend 'q'", experts_dtype=FP8)
    with pytest.raises(ValueError, match="'q' reads torch.float8_e4m3fn, which no dispatch "
                                         "kernel produces from torch.bfloat16 activations"):
        resolve_dispatch_dtype(BF16, sides=sides)


def test_registered_backends_declare_their_sides():
    reference = DispatchSides.of(REGISTRY.a2a["all_to_all"], REGISTRY.experts["reference"])
    assert reference.sends_quantized
    assert reference.experts_quantized_rows == ("fp8_token", "fp8_group")
    assert REGISTRY.a2a["allgather"].sends_quantized
    # DeepEP's own fp8 dispatch (tests/test_deepep_emulated.py).
    assert REGISTRY.a2a["deepep"].sends_quantized
    assert REGISTRY.experts["cpu"].quantized_rows == ()


def test_two_layers_resolve_independently_and_touch_no_environment():
    environment = dict(os.environ)
    first = resolve_dispatch_dtype(torch.float16)
    second = resolve_dispatch_dtype(torch.float32)
    third = resolve_dispatch_dtype(BF16, quant=W8A8_TOKEN, sides=READS_FP8)
    fourth = resolve_dispatch_dtype(BF16, quant=W8A8_TOKEN, sides=QUANTIZES_INSIDE)
    assert (first.dtype, second.dtype, third.dtype, fourth.dtype) == (
        torch.float16, torch.float32, FP8, BF16)
    assert dict(os.environ) == environment


@pytest.mark.parametrize("a2a, experts", [("flashinfer", "triton")])
def test_registered_pairs_that_cannot_both_take_fp8_dispatch_unquantized(a2a, experts):
    # FlashInfer's all-to-all moves bf16 here (no dispatch_quant): experts that read fp8
    # rows (triton) get bf16 rows, and quantize them.
    sides = DispatchSides.of(REGISTRY.a2a[a2a], REGISTRY.experts[experts])
    assert not sides.sends_quantized
    assert _no_warning(quant=W8A8_TOKEN, sides=sides) == DispatchDtype(BF16, DEFAULT_RULE)
    chosen, message = _one_warning(explicit=FP8, quant=W8A8_TOKEN, sides=sides)
    assert chosen == DispatchDtype(BF16, DEFAULT_RULE)
    assert f"a2a backend {a2a!r} cannot send fp8 rows" in message


def test_deepep_low_latency_bf16_feeding_experts_that_quantize_inside_gets_bf16():
    # DeepEP can send fp8 rows, but keeps bf16 for experts that quantize each row
    # themselves: fp8 rows there would be read as bf16.
    sides = DispatchSides.of(REGISTRY.a2a["deepep"], REGISTRY.experts["grouped_mm"])
    assert sides.sends_quantized and sides.experts_quantized_rows == ()
    assert _no_warning(quant=W8A8_TOKEN, sides=sides) == DispatchDtype(BF16, DEFAULT_RULE)
    assert _no_warning(quant=W8A8_GROUP, sides=sides) == DispatchDtype(BF16, DEFAULT_RULE)
