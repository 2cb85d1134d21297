"""The masked format (`ops.masked`) of quantized layers: ``moe::experts_masked_quant`` and
``moe::dispatch_masked_quant``.

Legend: T tokens (this rank's), H hidden size, K experts per token, E experts held here,
C rows per expert, G activation scale groups per row (``H / bk`` for ``fp8_group``).

``experts_masked_quant`` is ``experts_masked`` on quantized weights (`ops.quant`), as
``experts_rows_quant`` is ``experts_rows``: each expert on the rows of its block below its
count, rows past it neither read nor specified. Its blocks may arrive quantized already:
then ``x_masked`` is float8_e4m3fn with ``x_scale`` (``[E, C]`` for ``fp8_token``,
``[E, C, G]`` for ``fp8_group``) and ``out_dtype`` names the output dtype; otherwise
``x_scale`` and ``out_dtype`` are None and the output has ``x_masked``'s dtype.

``dispatch_masked_quant`` is ``dispatch_masked`` whose blocks travel in fp8, with their
scales last: what ``experts_masked_quant`` reads as ``(x_masked, x_scale)`` with
``out_dtype=hidden.dtype``. Only activation formats that quantize are taken.

Quantized layers serve inference: neither op has a gradient, and asking for one raises.
"""

from __future__ import annotations

import torch

from torch_moe_ops import quant
from torch_moe_ops.ops import checks, dispatch_quant, masked, rows, tokens
from torch_moe_ops.ops.library import GENERIC_NAMESPACE, OpContract, define
from torch_moe_ops.ops.quant import (
    OUT_DTYPES,
    QUANT_EXPERT_ARGS,
    check_quantized_activations,
    no_gradient_autograd,
    rows_out_dtype,
    spec_of,
)

SCHEMA = (f"(Tensor x_masked, Tensor? x_scale, Tensor count_experts, "
          f"{QUANT_EXPERT_ARGS}, ScalarType? out_dtype=None) -> Tensor")
DISPATCH_SCHEMA = ("(Tensor hidden, Tensor topk_weights, Tensor topk_ids, int num_experts, "
                   "str weight_format, str activation_format, int[] block_size, "
                   f"{rows.EP_ARGS}) -> (Tensor x_masked, Tensor count_experts, "
                   "Tensor src_info, Tensor layout_range, Tensor x_scale)")


def check(x_ECH, x_scale, count_E, *quant_args) -> None:
    checks.check_tensor("x_masked", x_ECH, 3, (*OUT_DTYPES, quant.FP8_DTYPE))
    checks.check_tensor("count_experts", count_E, 1, (torch.int32,))
    check_quantized_activations("x_masked", x_ECH, x_scale, *quant_args)
    num_experts = quant_args[0].shape[0]
    checks.check_size("x_masked", x_ECH, 0, num_experts, "w13.shape[0] (E)")
    checks.check_size("count_experts", count_E, 0, num_experts, "w13.shape[0] (E)")
    checks.check_same_device("x_masked", x_ECH, count_experts=count_E)


def check_values(x_ECH, x_scale, count_E, *_) -> None:
    masked.check_values(x_ECH, count_E)


def fake(x_ECH, x_scale, count_E, *quant_args):
    return x_ECH.new_empty(tuple(x_ECH.shape),
                           dtype=rows_out_dtype(x_ECH, quant_args[-1]))


def check_dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, weight_format,
                   activation_format, block_size, *ep_args) -> None:
    tokens.check_dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, *ep_args)
    dispatch_quant.check_spec(hidden_TH, weight_format, activation_format, block_size)


def fake_dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, weight_format,
                  activation_format, block_size, *ep_args):
    x_ECH, *bookkeeping = masked.fake_dispatch(hidden_TH, topk_weights_TK, topk_ids_TK,
                                               num_experts, *ep_args)
    spec = spec_of(weight_format, activation_format, block_size)
    num_local, rows_per_expert, hidden_size = x_ECH.shape
    rows_scale = dispatch_quant.scale_shape(spec, num_local * rows_per_expert, hidden_size)
    x_scale = x_ECH.new_empty((num_local, rows_per_expert, *rows_scale[1:]),
                              dtype=torch.float32)
    return (x_ECH.new_empty(tuple(x_ECH.shape), dtype=quant.FP8_DTYPE), *bookkeeping, x_scale)


_setup, _backward = no_gradient_autograd("moe::experts_masked_quant")
CONTRACT = OpContract(name="experts_masked_quant", schema=SCHEMA, check=check, fake=fake,
                      check_values=check_values, backward=_backward, setup_context=_setup)
_setup, _backward = no_gradient_autograd("moe::dispatch_masked_quant")
DISPATCH = OpContract(name="dispatch_masked_quant", schema=DISPATCH_SCHEMA,
                      check=check_dispatch, fake=fake_dispatch,
                      check_values=rows.check_dispatch_values, backward=_backward,
                      setup_context=_setup, ordered=True)
CONTRACTS = {contract.name: contract for contract in (CONTRACT, DISPATCH)}
experts_masked_quant = define(GENERIC_NAMESPACE, CONTRACT)
dispatch_masked_quant = define(GENERIC_NAMESPACE, DISPATCH)
