"""`MoEConfig` rejects non-finite floats when it is built, and the ops reject them
when they are called: the error names the field or argument, never a later NaN.

Legend: T tokens, H hidden size, I expert intermediate size, E experts,
K experts per token.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

import torch_moe_ops as tmo
from torch_moe_ops.config import FLOAT_FIELDS

NON_FINITE = {"nan": math.nan, "inf": math.inf}
BASE = {"hidden_size": 8, "intermediate_size": 4, "num_experts": 4, "top_k": 2}


@pytest.mark.parametrize("value", sorted(NON_FINITE))
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_config_rejects_non_finite_floats(field, value):
    with pytest.raises(ValueError, match=re.escape(f"{field} must be a finite float, got {value}")):
        tmo.MoEConfig(**BASE, **{field: NON_FINITE[value]})


def test_static_float_reads_the_field():
    cfg = tmo.MoEConfig(**BASE, routed_scaling_factor=2, swiglu_alpha=1.5, swiglu_limit=0.1)
    assert [cfg.static_float(field) for field in FLOAT_FIELDS] == [2.0, 1.5, 0.1]
    replaced = dataclasses.replace(cfg, swiglu_limit=3.0)
    assert replaced.static_float("swiglu_limit") == 3.0
    # Not a field: equal configs stay equal, and hash alike.
    assert cfg == dataclasses.replace(cfg) and hash(cfg) == hash(dataclasses.replace(cfg))
    assert "_float_text" not in {f.name for f in dataclasses.fields(cfg)}


def experts_args(swiglu_alpha: float, swiglu_limit: float) -> tuple:
    T, H, I, E, K = 3, 8, 4, 4, 2
    return (torch.randn(T, H), torch.rand(T, K), torch.zeros(T, K, dtype=torch.int32),
            torch.randn(E, 2 * I, H), torch.randn(E, H, I), None, None, "swiglu_oai",
            swiglu_alpha, swiglu_limit)


OP_CASES = {
    "experts_alpha": (lambda v: torch.ops.moe.experts(*experts_args(v, 7.0)), "swiglu_alpha"),
    "experts_limit": (lambda v: torch.ops.moe.experts(*experts_args(1.702, v)), "swiglu_limit"),
    "route_scale": (lambda v: torch.ops.moe.route(torch.randn(3, 4), None, 2, "softmax", False,
                                                  1, 1, v), "routed_scaling_factor"),
    "experts_rows_limit": (lambda v: torch.ops.moe.experts_rows(
        torch.randn(2, 8), torch.zeros(2, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
        *experts_args(1.702, v)[3:]), "swiglu_limit"),
}


@pytest.mark.parametrize("value", [*sorted(NON_FINITE), "-inf"])
@pytest.mark.parametrize("case", sorted(OP_CASES))
def test_ops_reject_non_finite_floats(case, value):
    call, name = OP_CASES[case]
    with pytest.raises(ValueError, match=re.escape(f"{name} must be finite, got {value}")):
        call(float(value))
