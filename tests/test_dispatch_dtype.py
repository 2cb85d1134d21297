"""The dispatch dtype rule: explicit > quantization spec > experts backend > hardware
default, one warning on a fallback, an error where falling back would be wrong,
and no process state (two layers may resolve differently)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from torch_moe_ops.backends import dispatch_dtype as rule
from torch_moe_ops.backends.dispatch_dtype import DispatchDtype, resolve_dispatch_dtype

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
DEFAULT = "hardware default (the activation dtype)"


def _no_warning(**kwargs) -> DispatchDtype:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return resolve_dispatch_dtype(BF16, **kwargs)


def test_default_is_the_activation_dtype():
    assert _no_warning() == DispatchDtype(BF16, DEFAULT)
    assert resolve_dispatch_dtype(torch.float32) == DispatchDtype(torch.float32, DEFAULT)


def test_explicit_argument_comes_first():
    assert _no_warning(explicit=BF16, experts_dtype=BF16) == DispatchDtype(
        BF16, "dispatch_dtype argument")


def test_experts_backend_before_the_default():
    assert _no_warning(experts_dtype=BF16, experts_name="'x'") == DispatchDtype(
        BF16, "experts backend 'x'")


def test_quant_spec_before_the_experts_backend(monkeypatch):
    monkeypatch.setitem(rule.QUANT_DISPATCH_DTYPES, "w16", BF16)
    assert _no_warning(quant="w16", experts_dtype=BF16) == DispatchDtype(
        BF16, "quantization spec 'w16'")


def test_impossible_explicit_choice_falls_back_with_one_warning_naming_both():
    with pytest.warns(UserWarning) as caught:
        chosen = resolve_dispatch_dtype(BF16, explicit=FP8)
    assert chosen == DispatchDtype(BF16, DEFAULT)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "torch.float8_e4m3fn (dispatch_dtype argument)" in message
    assert f"torch.bfloat16 ({DEFAULT})" in message


def test_quant_spec_that_cannot_be_met_raises(monkeypatch):
    monkeypatch.setitem(rule.QUANT_DISPATCH_DTYPES, "w8a8", FP8)
    with pytest.raises(ValueError, match="falling back would run other numerics"):
        resolve_dispatch_dtype(BF16, quant="w8a8")


def test_experts_backend_reading_what_no_kernel_makes_raises():
    with pytest.raises(ValueError, match="'q' reads torch.float8_e4m3fn, which no dispatch "
                                         "kernel produces from torch.bfloat16 activations"):
        resolve_dispatch_dtype(BF16, experts_dtype=FP8, experts_name="'q'")


def test_two_layers_resolve_independently_and_touch_no_environment():
    environment = dict(os.environ)
    first = resolve_dispatch_dtype(torch.float16)
    second = resolve_dispatch_dtype(torch.float32)
    assert (first.dtype, second.dtype) == (torch.float16, torch.float32)
    assert dict(os.environ) == environment
