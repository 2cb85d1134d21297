"""``moe::dispatch_quant``: ``moe::dispatch`` whose rows travel quantized to fp8.

Legend: T tokens (this rank's), H hidden size, K experts per token, E experts,
R rows (as ``moe::dispatch`` has them), G activation scale groups per row
(``H / bk`` for ``fp8_group``).

    spec = QuantSpec(weight_format, activation_format, block_size or None)
    q_TH, scale = quant.quantize_activations(hidden, spec)      # each token once, here
    x_rows, expert_rows, weight_rows, src_rows, count_experts, combine_map =
        dispatch(q_TH with its scales, topk_weights, topk_ids, ...)
    x_scale[r] = scale[token of row r]     # [R] (fp8_token) or [R, G] (fp8_group), fp32

The outputs are ``moe::dispatch``'s six, in its order, ``x_rows`` in
float8_e4m3fn, then ``x_scale``: what ``moe::experts_rows_quant`` reads as
``(x_rows, x_scale)`` with ``out_dtype=hidden.dtype``. Rows that carry nothing
(``expert_rows == -1``) are skipped, and hold what they hold in ``moe::dispatch``,
quantized or zero bytes. Only the way there is quantized: ``moe::combine`` takes
the experts' output in the activation dtype.

A row is a copy of its token, so quantizing before the transport gives every
row the values ``experts_rows_quant`` would compute from the unquantized row
(`quant.quantize_activations` on either side): the rows move in about half the
bytes of bf16, with the same numerics.

Layers call ``moe::dispatch``; the lowering puts this op in its place where the
layer's dispatch dtype resolves to fp8 (`torch_moe_ops.backends.dispatch_dtype`).
Only activation formats that quantize (``fp8_token``, ``fp8_group``) are taken.
Quantized layers serve inference: the op has no gradient, and asking for one raises.
"""

from __future__ import annotations

import torch

from torch_moe_ops import quant
from torch_moe_ops.config import QuantSpec
from torch_moe_ops.ops import rows
from torch_moe_ops.ops.library import GENERIC_NAMESPACE, OpContract, define
from torch_moe_ops.ops.quant import no_gradient_autograd, spec_of

# The activation formats whose rows dispatch can send quantized.
FP8_ACTIVATION_FORMATS = ("fp8_token", "fp8_group")
SCHEMA = ("(Tensor hidden, Tensor topk_weights, Tensor topk_ids, int num_experts, "
          f"str weight_format, str activation_format, int[] block_size, {rows.EP_ARGS}, "
          "int capacity=0) -> (Tensor x_rows, Tensor expert_rows, Tensor weight_rows, "
          "Tensor src_rows, Tensor count_experts, Tensor combine_map, Tensor x_scale)")


def scale_shape(spec: QuantSpec, num_rows: int, hidden_size: int) -> tuple[int, ...]:
    """The shape of the scales of ``[num_rows, H]`` fp8 rows: ``[R]`` or ``[R, G]``."""
    if spec.activations == "fp8_token":
        return (num_rows,)
    return (num_rows, hidden_size // quant.activation_group(spec, hidden_size))


def check_spec(hidden_TH: torch.Tensor, weight_format, activation_format,
               block_size) -> QuantSpec:
    """The spec of a ``dispatch_quant`` call, checked against ``hidden``'s width."""
    spec = spec_of(weight_format, activation_format, block_size)
    if spec.activations not in FP8_ACTIVATION_FORMATS:
        raise ValueError(f"activation_format must be one of "
                         f"{', '.join(map(repr, FP8_ACTIVATION_FORMATS))} (dispatch_quant "
                         f"sends rows quantized to fp8), got {activation_format!r}")
    hidden_size = hidden_TH.shape[1]
    group = quant.activation_group(spec, hidden_size)
    if hidden_size % group:
        raise ValueError(f"hidden.shape[1] must be a multiple of block_size[1] ({group}, the "
                         f"columns of one {spec.activations} scale), got shape "
                         f"{tuple(hidden_TH.shape)}")
    return spec


def check(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, weight_format,
          activation_format, block_size, *dispatch_args) -> None:
    rows.check_dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, *dispatch_args)
    check_spec(hidden_TH, weight_format, activation_format, block_size)


def check_values(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, *_) -> None:
    rows.check_dispatch_values(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts)


def fake(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, weight_format,
         activation_format, block_size, *dispatch_args):
    x_RH, *routing = rows.fake_dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts,
                                        *dispatch_args)
    spec = QuantSpec.from_op_args(weight_format, activation_format, block_size)
    x_scale = x_RH.new_empty(scale_shape(spec, *x_RH.shape), dtype=torch.float32)
    return (x_RH.new_empty(tuple(x_RH.shape), dtype=quant.FP8_DTYPE), *routing, x_scale)


_setup, _backward = no_gradient_autograd("moe::dispatch_quant")
CONTRACT = OpContract(name="dispatch_quant", schema=SCHEMA, check=check, fake=fake,
                      check_values=check_values, backward=_backward, setup_context=_setup,
                      ordered=True)
dispatch_quant = define(GENERIC_NAMESPACE, CONTRACT)
