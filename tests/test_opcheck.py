"""`torch.library.opcheck` on every generic op (``moe::*``) and every concrete op of
every registered backend that runs on the CPU here (the registry lists them, so a
new backend is covered as soon as it registers): schema, fake kernel (sizes,
strides, dtypes), autograd registration and AOT dispatch. And every op's schema
against the one written out below.

Legend: T tokens, H hidden size, I expert intermediate size, E experts,
K experts per token, F = 2*I, R rows.
"""

from __future__ import annotations

import pytest
import torch

from conftest import FP8_CPU_OPCHECK_UTILS
from torch_moe_ops import quant
from torch_moe_ops.backends.problems import problem_of
from torch_moe_ops.backends.registry import (
    A2A_OPS,
    BACKWARD_NAMESPACE,
    EXPERTS_OPS,
    MASKED_OPS,
    QUANT_A2A_OPS,
    QUANT_EXPERTS_OPS,
    REGISTRY,
    TOKENS_OPS,
    Problem,
)
from torch_moe_ops.config import BackendSpec, QuantSpec
from torch_moe_ops.ops import CONTRACTS, GENERIC_NAMESPACE, op_overload

H, I, E, K = 8, 4, 4, 2
CPU = torch.device("cpu")
# The contract, written out rather than read from the code that defines the ops.
EXPERT_ARGS = ("Tensor w13, Tensor w2, Tensor? b13, Tensor? b2, str activation, "
               "float swiglu_alpha, float swiglu_limit")
EP_ARGS = 'int ep_size=1, str group_name="", int max_tokens_per_rank=0'
SCHEMAS = {
    "route": "(Tensor router_logits, Tensor? correction_bias, int top_k, str scoring, "
             "bool renormalize, int num_expert_groups, int topk_groups, "
             "float routed_scaling_factor) -> (Tensor topk_weights, Tensor topk_ids)",
    "experts": f"(Tensor hidden, Tensor topk_weights, Tensor topk_ids, {EXPERT_ARGS}) -> Tensor",
    "experts_backward": "(Tensor grad_out, Tensor hidden, Tensor topk_weights, Tensor topk_ids, "
                        f"{EXPERT_ARGS}) -> (Tensor grad_hidden, Tensor grad_topk_weights, "
                        "Tensor grad_w13, Tensor grad_w2, Tensor grad_b13, Tensor grad_b2)",
    "dispatch": "(Tensor hidden, Tensor topk_weights, Tensor topk_ids, int num_experts, "
                f"{EP_ARGS}, int capacity=0) -> "
                "(Tensor x_rows, Tensor expert_rows, Tensor weight_rows, Tensor src_rows, "
                "Tensor count_experts, Tensor combine_map)",
    "experts_rows": "(Tensor x_rows, Tensor expert_rows, Tensor count_experts, "
                    f"{EXPERT_ARGS}) -> Tensor",
    "combine": f"(Tensor y_rows, Tensor weight_rows, Tensor src_rows, Tensor combine_map, "
               f"{EP_ARGS}) -> Tensor",
    "dispatch_backward": "(Tensor grad_x_rows, Tensor grad_weight_rows, Tensor src_rows, "
                         f"Tensor combine_map, {EP_ARGS}) -> "
                         "(Tensor grad_hidden, Tensor grad_topk_weights)",
    "combine_backward": "(Tensor grad_out, Tensor y_rows, Tensor weight_rows, Tensor src_rows, "
                        f"Tensor combine_map, {EP_ARGS}) -> "
                        "(Tensor grad_y_rows, Tensor grad_weight_rows)",
    "experts_quant": "(Tensor hidden, Tensor topk_weights, Tensor topk_ids, Tensor w13, "
                     "Tensor w2, Tensor w13_scale, Tensor w2_scale, Tensor? b13, Tensor? b2, "
                     "str weight_format, str activation_format, int[] block_size, "
                     "str activation, float swiglu_alpha, float swiglu_limit) -> Tensor",
    "experts_rows_quant": "(Tensor x_rows, Tensor? x_scale, Tensor expert_rows, "
                          "Tensor count_experts, Tensor w13, Tensor w2, Tensor w13_scale, "
                          "Tensor w2_scale, Tensor? b13, Tensor? b2, str weight_format, "
                          "str activation_format, int[] block_size, str activation, "
                          "float swiglu_alpha, float swiglu_limit, "
                          "ScalarType? out_dtype=None) -> Tensor",
    "dispatch_quant": "(Tensor hidden, Tensor topk_weights, Tensor topk_ids, int num_experts, "
                      "str weight_format, str activation_format, int[] block_size, "
                      f"{EP_ARGS}, int capacity=0) -> "
                      "(Tensor x_rows, Tensor expert_rows, Tensor weight_rows, Tensor src_rows, "
                      "Tensor count_experts, Tensor combine_map, Tensor x_scale)",
    "dispatch_tokens": "(Tensor hidden, Tensor topk_weights, Tensor topk_ids, int num_experts, "
                       f"{EP_ARGS}) -> (Tensor x_tokens, Tensor topk_weights_tokens, "
                       "Tensor topk_ids_tokens)",
    "combine_tokens": f"(Tensor y_tokens, Tensor topk_ids, int num_experts, {EP_ARGS}) -> Tensor",
    "dispatch_tokens_backward": "(Tensor grad_x_tokens, Tensor grad_topk_weights_tokens, "
                                f"Tensor topk_ids, int num_experts, {EP_ARGS}) -> "
                                "(Tensor grad_hidden, Tensor grad_topk_weights)",
    "combine_tokens_backward": f"(Tensor grad_out, Tensor topk_ids, int num_experts, {EP_ARGS}) "
                               "-> Tensor",
    "experts_masked": f"(Tensor x_masked, Tensor count_experts, {EXPERT_ARGS}) -> Tensor",
    "experts_masked_backward": f"(Tensor grad_out, Tensor x_masked, Tensor count_experts, "
                               f"{EXPERT_ARGS}) -> (Tensor grad_x_masked, Tensor grad_w13, "
                               "Tensor grad_w2, Tensor grad_b13, Tensor grad_b2)",
    "dispatch_masked": "(Tensor hidden, Tensor topk_weights, Tensor topk_ids, int num_experts, "
                       f"{EP_ARGS}) -> (Tensor x_masked, Tensor count_experts, "
                       "Tensor src_info, Tensor layout_range)",
    "combine_masked": "(Tensor y_masked, Tensor src_info, Tensor layout_range, "
                      "Tensor topk_weights, Tensor topk_ids, int num_experts, "
                      f"{EP_ARGS}) -> Tensor",
    "experts_masked_quant": "(Tensor x_masked, Tensor? x_scale, Tensor count_experts, "
                            "Tensor w13, Tensor w2, Tensor w13_scale, Tensor w2_scale, "
                            "Tensor? b13, Tensor? b2, str weight_format, "
                            "str activation_format, int[] block_size, str activation, "
                            "float swiglu_alpha, float swiglu_limit, "
                            "ScalarType? out_dtype=None) -> Tensor",
    "dispatch_masked_quant": "(Tensor hidden, Tensor topk_weights, Tensor topk_ids, "
                             "int num_experts, str weight_format, str activation_format, "
                             f"int[] block_size, {EP_ARGS}) -> (Tensor x_masked, "
                             "Tensor count_experts, Tensor src_info, Tensor layout_range, "
                             "Tensor x_scale)",
}
# The ops of the masked format's experts, and the transport ops that run on several ranks only.
MASKED_EXPERTS_OPS = ("experts_masked", "experts_masked_backward")
MULTI_RANK_OPS = TOKENS_OPS + MASKED_OPS
# The ops on quantized experts and rows: cases of their own (QUANT_CASES).
QUANT_OPS = QUANT_EXPERTS_OPS + QUANT_A2A_OPS


def implementations(dtype: torch.dtype, spec: QuantSpec = None
                    ) -> dict[tuple[str, str], str | None]:
    """``(namespace, op) -> None`` for every op that should run on the CPU with
    ``dtype`` (and quantized weights of ``spec``) here, or the reason it does not
    (what the backend's `supports` says)."""
    found = {(GENERIC_NAMESPACE, name): None for name in CONTRACTS}
    found.update({(backend.namespace, "route"):
                  backend.supports(BackendSpec(route=name), Problem(dtype), CPU)
                  for name, backend in REGISTRY.route.items()})
    found[(BACKWARD_NAMESPACE, "experts_backward")] = None
    found[(BACKWARD_NAMESPACE, "experts_masked_backward")] = None
    experts_reasons = {name: backend.supports(BackendSpec(experts=name), Problem(dtype), CPU)
                       for name, backend in REGISTRY.experts.items()}
    spec = spec or QuantSpec("fp8_channel")
    for name, backend in REGISTRY.experts.items():
        if hasattr(getattr(torch.ops, backend.namespace), QUANT_EXPERTS_OPS[0]):
            reason = backend.why_not(BackendSpec(experts=name), Problem(dtype, quant=spec), CPU)
            found.update({(backend.namespace, op): reason for op in QUANT_EXPERTS_OPS
                          if hasattr(getattr(torch.ops, backend.namespace), op)})
    # One process: the expert-parallel backends are opchecked on several
    # (tests/test_expert_parallel.py).
    a2a_reasons = {name: backend.supports(BackendSpec(a2a=name), Problem(dtype, ep_size=1), CPU)
                   for name, backend in REGISTRY.a2a.items()}
    for name, backend in REGISTRY.experts.items():
        own_backward = ("experts_backward",) if backend.backward is not None else ()
        found.update({(backend.namespace, op): experts_reasons[name]
                      for op in EXPERTS_OPS + own_backward + MASKED_EXPERTS_OPS
                      if hasattr(getattr(torch.ops, backend.namespace), op)})
    for name, backend in REGISTRY.a2a.items():
        found.update({(backend.namespace, op): a2a_reasons[name] for op in A2A_OPS})
        if backend.sends_quantized:
            found.update({(backend.namespace, op): a2a_reasons[name] for op in QUANT_A2A_OPS})
    # The tokens and masked formats' transport ops (registry.TOKENS_OPS, MASKED_OPS) run on
    # several ranks only (tests/test_tokens_transport.py and the emulated transports check
    # them).
    return found


ROUTE_CASES = {  # name: (T, E, top_k, scoring, renormalize, groups, topk_groups, scale, dtype)
    "softmax": (5, E, 2, "softmax", False, 1, 1, 1.0, torch.float32),
    "softmax_renormalize_bf16": (5, E, 2, "softmax", True, 1, 1, 1.0, torch.bfloat16),
    "topk_softmax_fp16": (5, E, 2, "topk_softmax", False, 1, 1, 1.0, torch.float16),
    "deepseek_v3": (5, 16, 4, "sigmoid", True, 4, 2, 2.5, torch.float32),
    "sigmoid_T0": (0, E, 2, "sigmoid", False, 1, 1, 1.0, torch.float32),
    "noncontiguous_logits": (5, E, 2, "softmax", True, 1, 1, 1.0, torch.float32),
}
EXPERT_CASES = {  # name: make_expert_inputs arguments, static (activation, alpha, limit)
    "silu_bias": ({"bias": True, "skip_fraction": 0.2}, ("silu", 1.702, 7.0)),
    "gelu_bias": ({"bias": True, "skip_fraction": 0.2}, ("gelu", 1.702, 7.0)),
    "swiglu_oai_bias": ({"bias": True, "skip_fraction": 0.2}, ("swiglu_oai", 1.702, 0.5)),
    "bf16": ({"dtype": torch.bfloat16}, ("silu", 1.702, 7.0)),
    "fp16_int64_ids": ({"dtype": torch.float16, "ids_dtype": torch.int64},
                       ("silu", 1.702, 7.0)),
    "T0_bias": ({"num_tokens": 0, "bias": True}, ("silu", 1.702, 7.0)),
    "all_skipped": ({"skip_fraction": 1.0}, ("silu", 1.702, 7.0)),
}
# name: each of the E experts' count of rows in blocks of MASKED_ROWS, make_expert_inputs
# arguments, static (activation, alpha, limit). Rows past a count hold garbage.
MASKED_ROWS = 3
MASKED_CASES = {
    "masked_full_bias": ((3, 3, 3, 3), {"bias": True}, ("silu", 1.702, 7.0)),
    "masked_partial_gelu": ((2, 0, 3, 1), {"bias": True}, ("gelu", 1.702, 7.0)),
    "masked_partial_fp16": ((1, 3, 0, 2), {"dtype": torch.float16}, ("swiglu_oai", 1.702, 0.5)),
    "masked_empty": ((0, 0, 0, 0), {}, ("silu", 1.702, 7.0)),
}
QUANT_SIZES = {"hidden_size": 64, "intermediate_size": 32, "num_experts": E, "top_k": K}
QUANT_CASES = {  # name: QuantSpec, make_quant_inputs arguments, static (activation, alpha, limit)
    "fp8_tensor": (QuantSpec("fp8_tensor"), {}, ("silu", 1.702, 7.0)),
    "fp8_channel_bf16": (QuantSpec("fp8_channel"), {"dtype": torch.bfloat16, "bias": True},
                         ("gelu", 1.702, 7.0)),
    "fp8_block_skips": (QuantSpec("fp8_block", block_size=(32, 32)), {"skip_fraction": 0.2},
                        ("silu", 1.702, 7.0)),
    "fp8_block_w8a16": (QuantSpec("fp8_block", "none", (32, 16)), {}, ("silu", 1.702, 7.0)),
    "mxfp4_bias": (QuantSpec("mxfp4"), {"bias": True}, ("swiglu_oai", 1.702, 7.0)),
    "fp8_channel_T0": (QuantSpec("fp8_channel"), {"num_tokens": 0}, ("silu", 1.702, 7.0)),
}
# The same values as a contiguous case, stored transposed: a fake kernel must give
# the real kernel's strides for these too.
NONCONTIGUOUS_CASES = ("noncontiguous_hidden", "noncontiguous_routing", "noncontiguous_weights")


def transposed_storage(t: torch.Tensor) -> torch.Tensor:
    """The same values with the last two dimensions' strides swapped (non-contiguous)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def with_grad(args: tuple) -> tuple:
    """Floating-point tensors require grad, so that autograd registration is checked."""
    return tuple(a.requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point()
                 else a for a in args)


def route_args(case: str, generator: torch.Generator) -> tuple:
    T, num_experts, top_k, scoring, renormalize, groups, topk_groups, scale, dtype = \
        ROUTE_CASES[case]
    logits_TE = torch.randn((T, num_experts), generator=generator).to(dtype)
    if case == "noncontiguous_logits":
        logits_TE = transposed_storage(logits_TE)
    bias_E = torch.rand(num_experts, generator=generator) if scoring == "sigmoid" else None
    return with_grad((logits_TE, bias_E, top_k, scoring, renormalize, groups, topk_groups,
                      scale))


def expert_args(case: str, expert_inputs) -> tuple:
    """The arguments of ``moe::experts`` for ``case``."""
    if case in NONCONTIGUOUS_CASES:
        inputs = expert_inputs(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K)
        if case == "noncontiguous_hidden":
            inputs.hidden_TH = transposed_storage(inputs.hidden_TH)
        elif case == "noncontiguous_routing":
            inputs.topk_weights_TK = transposed_storage(inputs.topk_weights_TK)
            inputs.topk_ids_TK = transposed_storage(inputs.topk_ids_TK)
        else:
            inputs.w13_EFH = transposed_storage(inputs.w13_EFH)
            inputs.w2_EHI = transposed_storage(inputs.w2_EHI)
        return inputs.args()
    sizes, static = EXPERT_CASES[case]
    inputs = expert_inputs(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, **sizes)
    return inputs.args(*static)


def quant_op_args(op_name: str, case: str, generator, quant_inputs) -> tuple:
    """The arguments of ``moe::experts_quant`` / ``moe::experts_rows_quant`` /
    ``moe::dispatch_quant`` for ``case`` (``"<case>_prequantized"``: rows quantized
    by dispatch, fp8). No input requires grad: the ops have none (tests/test_quant.py
    and tests/test_dispatch_quant.py check that asking raises)."""
    prequantized = case.endswith("_prequantized")
    spec, sizes, static = QUANT_CASES[case.removesuffix("_prequantized")]
    inputs = quant_inputs(spec, **QUANT_SIZES, **sizes)
    if op_name == "experts_quant":
        return inputs.args(*static)
    f = inputs.float_inputs
    if op_name == "experts_masked_quant":
        x_ECH = masked_blocks((2, 0, 3, 1), generator, f.hidden_TH.shape[1], f.hidden_TH.dtype)
        if not prequantized:
            return (x_ECH, None, torch.tensor((2, 0, 3, 1), dtype=torch.int32),
                    *inputs.weight_args(*static))
        x_q_LH, x_scale = quant.quantize_activations(x_ECH.flatten(0, 1), spec)
        return (x_q_LH.view(x_ECH.shape), x_scale.view(*x_ECH.shape[:2], *x_scale.shape[1:]),
                torch.tensor((2, 0, 3, 1), dtype=torch.int32), *inputs.weight_args(*static),
                x_ECH.dtype)
    if op_name == "dispatch_quant":
        return (f.hidden_TH, f.topk_weights_TK, f.topk_ids_TK, E, spec.weights,
                spec.activations, spec.block_list)
    x_RH, expert_R, _, _, count_E, _ = torch.ops.moe.dispatch(
        f.hidden_TH, f.topk_weights_TK, f.topk_ids_TK, E)
    if not prequantized:
        return (x_RH, None, expert_R, count_E, *inputs.weight_args(*static))
    x_q_RH, x_scale = quant.quantize_activations(x_RH, spec)
    return (x_q_RH, x_scale, expert_R, count_E, *inputs.weight_args(*static), x_RH.dtype)


def masked_blocks(counts: tuple, generator, hidden_size: int, dtype: torch.dtype
                  ) -> torch.Tensor:
    """``[E, MASKED_ROWS, H]`` blocks with ``counts`` rows that carry a token each, garbage
    (finite: the schema check compares inputs) past them."""
    count_E = torch.tensor(counts, dtype=torch.int32)
    x_ECH = torch.randn((len(counts), MASKED_ROWS, hidden_size), generator=generator)
    past_count_EC1 = (torch.arange(MASKED_ROWS) >= count_E.unsqueeze(1)).unsqueeze(2)
    return x_ECH.masked_fill(past_count_EC1, 1e4).to(dtype)


def masked_args(op_name: str, case: str, generator, expert_inputs) -> tuple:
    """The arguments of ``moe::experts_masked`` (``_backward``) for ``case``: `masked_blocks`."""
    counts, sizes, static = MASKED_CASES[case]
    inputs = expert_inputs(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, **sizes)
    count_E = torch.tensor(counts, dtype=torch.int32)
    x_ECH = masked_blocks(counts, generator, H, inputs.hidden_TH.dtype)
    weights = inputs.args(*static)[3:]
    if op_name == "experts_masked":
        return with_grad((x_ECH, count_E, *weights))
    return (torch.randn(x_ECH.shape, generator=generator).to(x_ECH.dtype), x_ECH, count_E,
            *weights)


def op_args(op_name: str, case: str, generator, expert_inputs, quant_inputs) -> tuple:
    if op_name in MASKED_EXPERTS_OPS:
        return masked_args(op_name, case, generator, expert_inputs)
    if op_name == "route":
        return route_args(case, generator)
    if op_name in QUANT_OPS:
        return quant_op_args(op_name, case, generator, quant_inputs)
    if case == "minus_one_rows":  # rows built by hand, -1 rows not at the end
        rows_RH = torch.randn((6, H), generator=generator)  # x_rows or y_rows
        if op_name == "experts_rows":
            expert_R = torch.tensor([0, -1, 2, 3, -1, 0], dtype=torch.int32)
            count_E = torch.tensor([2, 0, 1, 1], dtype=torch.int32)
            return (rows_RH, expert_R, count_E, *expert_args("silu_bias", expert_inputs)[3:])
        weight_R = torch.tensor([0.5, 1.0, 2.0, 0.0, 3.0, 0.0])
        # T = 3 tokens, K = 2: each row's slot, and each slot's row.
        src_R = torch.tensor([1, 0, 3, -1, 4, -1], dtype=torch.int32)
        row_of_slot_TK = torch.tensor([[1, 0], [-1, 2], [4, -1]], dtype=torch.int32)
        if op_name == "dispatch_backward":
            return rows_RH, weight_R, src_R, row_of_slot_TK
        if op_name == "combine_backward":
            return (torch.randn((3, H), generator=generator), rows_RH, weight_R, src_R,
                    row_of_slot_TK)
        return rows_RH, weight_R, src_R, row_of_slot_TK
    args = expert_args(case, expert_inputs)
    hidden_TH, weights_TK, ids_TK, *expert_weights_and_static = args
    if op_name == "experts":
        return with_grad(args)
    if op_name == "experts_backward":
        grad_out_TH = torch.randn(hidden_TH.shape, generator=generator).to(hidden_TH.dtype)
        return (grad_out_TH, *args)
    if op_name == "dispatch":
        return with_grad((hidden_TH, weights_TK, ids_TK, E))
    x_RH, expert_R, weight_R, src_R, count_E, combine_map_TK = torch.ops.moe.dispatch(
        hidden_TH, weights_TK, ids_TK, E)
    if case == "noncontiguous_hidden":
        x_RH = transposed_storage(x_RH)
    if op_name == "experts_rows":
        return with_grad((x_RH, expert_R, count_E, *expert_weights_and_static))
    if op_name == "dispatch_backward":
        return x_RH, weight_R, src_R, combine_map_TK
    y_RH = torch.randn(x_RH.shape, generator=generator).to(x_RH.dtype)
    if case == "noncontiguous_hidden":
        y_RH = transposed_storage(y_RH)
    if op_name == "combine_backward":
        grad_out_TH = torch.randn(hidden_TH.shape, generator=generator).to(hidden_TH.dtype)
        return grad_out_TH, y_RH, weight_R, src_R, combine_map_TK
    assert op_name == "combine"
    return with_grad((y_RH, weight_R, src_R, combine_map_TK))


def case_names(op_name: str) -> list:
    if op_name == "route":
        return list(ROUTE_CASES)
    if op_name in MASKED_EXPERTS_OPS:
        return list(MASKED_CASES)
    fp8_activations = [name for name, (spec, _, _) in QUANT_CASES.items()
                       if spec.activations != "none"]
    if op_name in QUANT_A2A_OPS:
        return fp8_activations
    if op_name in QUANT_EXPERTS_OPS:
        prequantized = [f"{name}_prequantized" for name in fp8_activations]
        return list(QUANT_CASES) + (prequantized if op_name in ("experts_rows_quant",
                                                                 "experts_masked_quant")
                                    else [])
    names = list(EXPERT_CASES)
    if op_name in ("experts_rows", "combine", "dispatch_backward", "combine_backward"):
        names.append("minus_one_rows")
    return names


def case_dtype(op_name: str, case: str) -> torch.dtype:
    if op_name == "route":
        return ROUTE_CASES[case][-1]
    if op_name in MASKED_EXPERTS_OPS:
        return MASKED_CASES[case][1].get("dtype", torch.float32)
    if op_name in QUANT_OPS:
        return QUANT_CASES[case.removesuffix("_prequantized")][1].get("dtype", torch.float32)
    return EXPERT_CASES.get(case, ({},))[0].get("dtype", torch.float32)


def route_reason(namespace: str, case: str) -> str | None:
    """Why route backend ``namespace`` does not compute ``case``'s routing (its `supports`
    on the case's own problem: groups, scoring, sizes), or None."""
    (name, backend), = ((n, b) for n, b in REGISTRY.route.items() if b.namespace == namespace)
    args = route_args(case, torch.Generator().manual_seed(0))
    return backend.supports(BackendSpec(route=name), problem_of("route", args), CPU)


def params():
    # The tokens and masked formats' transport ops move tokens between ranks only:
    # tests/test_tokens_transport.py and the emulated transports opcheck them on several.
    for op_name in (name for name in CONTRACTS if name not in MULTI_RANK_OPS):
        cases = case_names(op_name)
        if op_name not in ("route", *QUANT_OPS, *MASKED_EXPERTS_OPS):
            cases += NONCONTIGUOUS_CASES
        for case in cases:
            spec = (QUANT_CASES[case.removesuffix("_prequantized")][0]
                    if op_name in QUANT_OPS else None)
            for (namespace, name), reason in implementations(case_dtype(op_name, case),
                                                             spec).items():
                if name == op_name:
                    if op_name == "route" and reason is None and namespace != GENERIC_NAMESPACE:
                        reason = route_reason(namespace, case)
                    marks = [pytest.mark.skip(reason=f"{namespace}: {reason}")] if reason else []
                    yield pytest.param(namespace, op_name, case, marks=marks,
                                       id=f"{namespace}::{op_name}-{case}")


@pytest.mark.parametrize("namespace, op_name, case", list(params()))
def test_opcheck(namespace, op_name, case, generator, expert_inputs, quant_inputs):
    args = op_args(op_name, case, generator, expert_inputs, quant_inputs)
    utils = torch.library._OPCHECK_DEFAULT_UTILS
    if any(isinstance(a, torch.Tensor) and a.dtype == quant.FP8_DTYPE for a in args):
        utils = FP8_CPU_OPCHECK_UTILS
    if op_name == "experts_masked_quant" or (op_name == "experts_masked"
                                              and case != "masked_full_bias"):
        # Output rows past the counts are unspecified (a backend may leave them unwritten):
        # the eager-against-traced comparison, which reads every row, runs where all count.
        utils = tuple(u for u in utils if u != "test_aot_dispatch_dynamic")
    torch.library.opcheck(op_overload(namespace, op_name), args, test_utils=utils)


def test_every_op_is_covered():
    assert set(SCHEMAS) == set(CONTRACTS)
    concrete = {op for (namespace, op), reason in implementations(torch.float32).items()
                if namespace != GENERIC_NAMESPACE and reason is None}
    assert concrete == set(CONTRACTS) - set(MULTI_RANK_OPS)


def schema_params():
    for (namespace, op_name), reason in implementations(torch.float32).items():
        marks = []
        if reason is not None and not hasattr(getattr(torch.ops, namespace), op_name):
            marks = [pytest.mark.skip(reason=f"{namespace}::{op_name} is not defined: {reason}")]
        yield pytest.param(namespace, op_name, marks=marks, id=f"{namespace}::{op_name}")


@pytest.mark.parametrize("namespace, op_name", list(schema_params()))
def test_schema(namespace, op_name):
    assert str(op_overload(namespace, op_name)._schema) == \
        f"{namespace}::{op_name}{SCHEMAS[op_name]}"
