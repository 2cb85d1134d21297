"""``moe::experts_quant`` and ``moe::experts_rows_quant``: the experts ops on
quantized weights (`QuantSpec`), with their scales as inputs.

Legend: T tokens, H hidden size, I expert intermediate size, F = 2 * I,
E experts, K experts per token, R rows, G activation scale groups per row.

    spec = QuantSpec(weight_format, activation_format, block_size or None)
    W13, W2 = dequantize(w13, w13_scale), dequantize(w2, w2_scale)     (torch_moe_ops.quant)
    for t, k: if topk_ids[t, k] >= 0:
        e = topk_ids[t, k]
        a = act(Q(hidden[t]) @ W13[e].T + b13[e])
        out[t] += topk_weights[t, k] * (Q(a) @ W2[e].T + b2[e])

where ``Q`` rounds activations through fp8 as ``activation_format`` says
(`quant.round_trip_activations`; nothing for ``"none"``). Weight and scale
shapes per format are `quant.weight_shape` and `quant.scale_shape` of
``[E, F, H]`` and ``[E, H, I]``; biases are in the output dtype.

``experts_rows_quant`` runs each row through its own expert, unweighted, as
``experts_rows`` does. Its rows may arrive quantized already (an fp8
dispatch): then ``x_rows`` is float8_e4m3fn with ``x_scale`` (``[R]`` for
``fp8_token``, ``[R, H / bk]`` for ``fp8_group``) and ``out_dtype`` names the
output dtype; otherwise ``x_scale`` and ``out_dtype`` are None and the output
has ``x_rows``' dtype.

Quantized experts serve inference: the ops have no gradient, and a backward
through them raises (`no_gradient`); compiling a graph that could ask for one works.
"""

from __future__ import annotations

import torch

from torch_moe_ops import quant
from torch_moe_ops.config import (
    ACTIVATIONS,
    QUANT_ACTIVATION_FORMATS,
    QUANT_WEIGHT_FORMATS,
    QuantSpec,
)
from torch_moe_ops.ops import checks
from torch_moe_ops.ops.experts import check_routing
from torch_moe_ops.ops.library import GENERIC_NAMESPACE, OpContract, define
from torch_moe_ops.ops.no_gradient import refused_autograd

QUANT_EXPERT_ARGS = ("Tensor w13, Tensor w2, Tensor w13_scale, Tensor w2_scale, Tensor? b13, "
                     "Tensor? b2, str weight_format, str activation_format, int[] block_size, "
                     "str activation, float swiglu_alpha, float swiglu_limit")
SCHEMA = (f"(Tensor hidden, Tensor topk_weights, Tensor topk_ids, {QUANT_EXPERT_ARGS}) "
          "-> Tensor")
ROWS_SCHEMA = (f"(Tensor x_rows, Tensor? x_scale, Tensor expert_rows, Tensor count_experts, "
               f"{QUANT_EXPERT_ARGS}, ScalarType? out_dtype=None) -> Tensor")
# What quantized experts compute in and return: the float activations' dtypes.
OUT_DTYPES = checks.OP_FLOAT_DTYPES


def spec_of(weight_format: str, activation_format: str, block_size) -> QuantSpec:
    """The `QuantSpec` of an op call's static arguments, checked."""
    checks.check_choice("weight_format", weight_format, tuple(QUANT_WEIGHT_FORMATS))
    checks.check_choice("activation_format", activation_format, QUANT_ACTIVATION_FORMATS)
    allowed = QUANT_WEIGHT_FORMATS[weight_format]
    if activation_format not in allowed:
        raise ValueError(f"activation_format must be one of {', '.join(map(repr, allowed))} "
                         f"with weight_format={weight_format!r}, got {activation_format!r}")
    if weight_format == "fp8_block":
        if len(block_size) != 2 or min(block_size) <= 0:
            raise ValueError(f"block_size must be [rows, columns] of one scale block with "
                             f"weight_format='fp8_block', got {list(block_size)}")
    elif len(block_size):
        raise ValueError(f"block_size must be [] unless weight_format='fp8_block', got "
                         f"{list(block_size)} with weight_format={weight_format!r}")
    return QuantSpec.from_op_args(weight_format, activation_format, list(block_size))


def _check_weight(name: str, w: torch.Tensor, scale_name: str, scale: torch.Tensor,
                  spec: QuantSpec, num_experts: int, rows: int, cols: int) -> None:
    """``w`` and ``scale`` must be the stored form of ``[E, rows, cols]`` weights."""
    checks.check_tensor(name, w, 3, (quant.weight_dtype(spec),))
    stored = quant.weight_shape(spec, num_experts, rows, cols)
    if tuple(w.shape) != stored:
        raise ValueError(f"{name} must have shape {list(stored)} ({spec.weights} weights of "
                         f"[E, {rows}, {cols}]), got {list(w.shape)}")
    expected = quant.scale_shape(spec, num_experts, rows, cols)
    checks.check_tensor(scale_name, scale, len(expected), (quant.scale_dtype(spec),))
    if tuple(scale.shape) != expected:
        raise ValueError(f"{scale_name} must have shape {list(expected)} ({spec.weights} "
                         f"scales of [E, {rows}, {cols}] weights), got {list(scale.shape)}")


def check_quant_weights(x_name: str, x_NH: torch.Tensor, out_dtype: torch.dtype, w13, w2,
                        w13_scale, w2_scale, b13_EF, b2_EH, weight_format, activation_format,
                        block_size, activation, swiglu_alpha, swiglu_limit) -> QuantSpec:
    """Checks quantized weights against the activations ``x_NH`` they multiply;
    returns their spec."""
    spec = spec_of(weight_format, activation_format, block_size)
    hidden_size = x_NH.shape[1]
    checks.check_tensor("w13", w13, 3, (quant.weight_dtype(spec),))
    num_experts = w13.shape[0]
    if w13.shape[1] % 2:
        raise ValueError(f"w13.shape[1] must be even (gate rows then up rows, 2*I), "
                         f"got shape {tuple(w13.shape)}")
    inter_size = w13.shape[1] // 2
    spec.check_sizes(hidden_size, inter_size)
    _check_weight("w13", w13, "w13_scale", w13_scale, spec, num_experts, 2 * inter_size,
                  hidden_size)
    _check_weight("w2", w2, "w2_scale", w2_scale, spec, num_experts, hidden_size, inter_size)
    for name, bias, cols in (("b13", b13_EF, 2 * inter_size), ("b2", b2_EH, hidden_size)):
        if bias is not None:
            checks.check_tensor(name, bias, 2, (out_dtype,))
            checks.check_size(name, bias, 0, num_experts, "w13.shape[0] (E)")
            checks.check_size(name, bias, 1, cols, "2*I" if name == "b13" else "H")
    checks.check_same_device(x_name, x_NH, w13=w13, w2=w2, w13_scale=w13_scale,
                             w2_scale=w2_scale, b13=b13_EF, b2=b2_EH)
    checks.check_choice("activation", activation, ACTIVATIONS)
    checks.check_positive("swiglu_alpha", swiglu_alpha)
    checks.check_positive("swiglu_limit", swiglu_limit)
    return spec


def check(hidden_TH, topk_weights_TK, topk_ids_TK, *quant_args) -> None:
    check_routing(hidden_TH, topk_weights_TK, topk_ids_TK)
    check_quant_weights("hidden", hidden_TH, hidden_TH.dtype, *quant_args)


def check_values(hidden_TH, topk_weights_TK, topk_ids_TK, w13, *_) -> None:
    checks.check_ids_in_range("topk_ids", topk_ids_TK, w13.shape[0])


def fake(hidden_TH, *_):
    return torch.empty_like(hidden_TH, memory_format=torch.contiguous_format)


def rows_out_dtype(x_RH: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    return x_RH.dtype if out_dtype is None else out_dtype


def check_rows(x_RH, x_scale, expert_R, count_E, *quant_args) -> None:
    checks.check_tensor("x_rows", x_RH, 2, (*OUT_DTYPES, quant.FP8_DTYPE))
    checks.check_tensor("expert_rows", expert_R, 1, (torch.int32,))
    checks.check_tensor("count_experts", count_E, 1, (torch.int32,))
    checks.check_size("expert_rows", expert_R, 0, x_RH.shape[0], "x_rows.shape[0] (R)")
    check_quantized_activations("x_rows", x_RH, x_scale, *quant_args)
    checks.check_size("count_experts", count_E, 0, quant_args[0].shape[0], "w13.shape[0] (E)")
    checks.check_same_device("x_rows", x_RH, expert_rows=expert_R, count_experts=count_E)


def check_quantized_activations(x_name: str, x_XH, x_scale, *quant_args) -> QuantSpec:
    """Activations ``x_XH`` (``[..., H]``: float, or float8_e4m3fn as a dispatch quantized
    them, with ``x_scale`` ``[...]`` for fp8_token or ``[..., H / bk]`` for fp8_group, and
    ``out_dtype``) against the quantized weights of ``quant_args`` (schema order, then
    ``out_dtype``); returns their spec."""
    *weights, out_dtype = quant_args
    if x_XH.dtype == quant.FP8_DTYPE:
        if out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype must be one of "
                             f"({', '.join(str(d) for d in OUT_DTYPES)}) with float8 {x_name}, "
                             f"got {out_dtype}")
    elif x_scale is not None or out_dtype is not None:
        raise ValueError(f"x_scale and out_dtype must be None unless {x_name} is float8_e4m3fn "
                         f"(rows quantized by dispatch), got {x_name} of {x_XH.dtype} with "
                         f"x_scale={'a tensor' if x_scale is not None else None}, "
                         f"out_dtype={out_dtype}")
    spec = check_quant_weights(x_name, x_XH.reshape(-1, x_XH.shape[-1]),
                               rows_out_dtype(x_XH, out_dtype), *weights)
    if x_XH.dtype == quant.FP8_DTYPE:
        if spec.activations == "none":
            raise ValueError(f"{x_name} must not be quantized with activation_format='none' "
                             f"(weight-only {spec.weights}), got {x_XH.dtype}")
        hidden_size = x_XH.shape[-1]
        groups = hidden_size // quant.activation_group(spec, hidden_size)
        expected = tuple(x_XH.shape[:-1]) + (() if spec.activations == "fp8_token"
                                             else (groups,))
        checks.check_tensor("x_scale", x_scale, len(expected), (torch.float32,))
        if tuple(x_scale.shape) != expected:
            raise ValueError(f"x_scale must have shape {list(expected)} ({spec.activations} "
                             f"scales of {x_name} {list(x_XH.shape)}), got "
                             f"{list(x_scale.shape)}")
        checks.check_same_device(x_name, x_XH, x_scale=x_scale)
    return spec


def check_rows_values(x_RH, x_scale, expert_R, count_E, w13, *_) -> None:
    checks.check_ids_in_range("expert_rows", expert_R, w13.shape[0])


def fake_rows(x_RH, x_scale, expert_R, count_E, *quant_args):
    return x_RH.new_empty(tuple(x_RH.shape), dtype=rows_out_dtype(x_RH, quant_args[-1]))


NO_GRADIENT = ("{op} has no gradient: quantized experts serve inference. Train on "
               "unquantized weights (MoEConfig.quant=None), or run the layer under "
               "torch.no_grad()")


def no_gradient_autograd(op: str):
    """``(setup_context, backward)`` of an op without a gradient, ``op``: each
    input that asks for one gets `no_gradient.no_gradient`'s, which raises
    `NO_GRADIENT`."""
    return refused_autograd(lambda ctx: NO_GRADIENT.format(op=op))


_setup, _backward = no_gradient_autograd("moe::experts_quant")
CONTRACT = OpContract(name="experts_quant", schema=SCHEMA, check=check, fake=fake,
                      check_values=check_values, backward=_backward, setup_context=_setup)
_setup, _backward = no_gradient_autograd("moe::experts_rows_quant")
ROWS_CONTRACT = OpContract(name="experts_rows_quant", schema=ROWS_SCHEMA, check=check_rows,
                           fake=fake_rows, check_values=check_rows_values, backward=_backward,
                           setup_context=_setup)
experts_quant = define(GENERIC_NAMESPACE, CONTRACT)
experts_rows_quant = define(GENERIC_NAMESPACE, ROWS_CONTRACT)
