"""The rows format between dispatch, experts and combine.

Legend: T tokens, H hidden size, K experts per token, E experts held here,
R rows (a capacity fixed by the config: ``T * K`` on one device).

``moe::dispatch`` turns tokens and their routing into rows grouped by expert:
rows ``[offset_e, offset_e + count_E[e])`` belong to expert ``e`` (ascending),
the remaining rows have ``expert_R == -1`` and ``src_R == -1`` and are skipped.
``moe::experts_rows`` runs each row through its expert (skipped rows give 0)
and ``moe::combine`` adds ``weight_R * y_RH`` back into token ``src_R``.

    combine(experts_rows(*dispatch(h, w, ids))) == experts(h, w, ids)

These ops are forward-only: gradients flow through ``moe::experts``.
"""

from __future__ import annotations

import torch

from torch_moe_ops.ops import checks
from torch_moe_ops.ops.experts import EXPERT_ARGS, check_expert_weights, check_routing
from torch_moe_ops.ops.library import GENERIC_NAMESPACE, OpContract, define

DISPATCH_SCHEMA = ("(Tensor hidden, Tensor topk_weights, Tensor topk_ids, int num_experts) -> "
                   "(Tensor x_rows, Tensor expert_rows, Tensor weight_rows, Tensor src_rows, "
                   "Tensor count_experts)")
EXPERTS_ROWS_SCHEMA = (f"(Tensor x_rows, Tensor expert_rows, Tensor count_experts, "
                       f"{EXPERT_ARGS}) -> Tensor")
COMBINE_SCHEMA = ("(Tensor y_rows, Tensor weight_rows, Tensor src_rows, SymInt num_tokens) "
                  "-> Tensor")


def check_dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts) -> None:
    check_routing(hidden_TH, topk_weights_TK, topk_ids_TK)
    if num_experts <= 0:
        raise ValueError(f"num_experts must be > 0, got {num_experts}")


def check_dispatch_values(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts) -> None:
    checks.check_ids_in_range("topk_ids", topk_ids_TK, num_experts)


def fake_dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts):
    num_rows = topk_ids_TK.numel()
    return (hidden_TH.new_empty((num_rows, hidden_TH.shape[1])),
            hidden_TH.new_empty((num_rows,), dtype=torch.int32),
            hidden_TH.new_empty((num_rows,), dtype=torch.float32),
            hidden_TH.new_empty((num_rows,), dtype=torch.int32),
            hidden_TH.new_empty((num_experts,), dtype=torch.int32))


def check_experts_rows(x_RH, expert_R, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH, activation,
                       swiglu_alpha, swiglu_limit) -> None:
    checks.check_tensor("x_rows", x_RH, 2, checks.OP_FLOAT_DTYPES)
    checks.check_tensor("expert_rows", expert_R, 1, (torch.int32,))
    checks.check_tensor("count_experts", count_E, 1, (torch.int32,))
    checks.check_size("expert_rows", expert_R, 0, x_RH.shape[0], "x_rows.shape[0] (R)")
    check_expert_weights("x_rows", x_RH, w13_EFH, w2_EHI, b13_EF, b2_EH, activation,
                         swiglu_alpha, swiglu_limit)
    checks.check_size("count_experts", count_E, 0, w13_EFH.shape[0], "w13.shape[0] (E)")
    checks.check_same_device("x_rows", x_RH, expert_rows=expert_R, count_experts=count_E)


def check_experts_rows_values(x_RH, expert_R, count_E, w13_EFH, *_) -> None:
    checks.check_ids_in_range("expert_rows", expert_R, w13_EFH.shape[0])


def fake_experts_rows(x_RH, *_):
    return torch.empty_like(x_RH, memory_format=torch.contiguous_format)


def check_combine(y_RH, weight_R, src_R, num_tokens) -> None:
    checks.check_tensor("y_rows", y_RH, 2, checks.OP_FLOAT_DTYPES)
    checks.check_tensor("weight_rows", weight_R, 1, (torch.float32,))
    checks.check_tensor("src_rows", src_R, 1, (torch.int32,))
    checks.check_size("weight_rows", weight_R, 0, y_RH.shape[0], "y_rows.shape[0] (R)")
    checks.check_size("src_rows", src_R, 0, y_RH.shape[0], "y_rows.shape[0] (R)")
    checks.check_same_device("y_rows", y_RH, weight_rows=weight_R, src_rows=src_R)
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")


def check_combine_values(y_RH, weight_R, src_R, num_tokens) -> None:
    checks.check_ids_in_range("src_rows", src_R, num_tokens, "token indices")


def fake_combine(y_RH, weight_R, src_R, num_tokens):
    return y_RH.new_empty((num_tokens, y_RH.shape[1]))


DISPATCH = OpContract(name="dispatch", schema=DISPATCH_SCHEMA, check=check_dispatch,
                      check_values=check_dispatch_values, fake=fake_dispatch)
EXPERTS_ROWS = OpContract(name="experts_rows", schema=EXPERTS_ROWS_SCHEMA,
                          check=check_experts_rows, check_values=check_experts_rows_values,
                          fake=fake_experts_rows)
COMBINE = OpContract(name="combine", schema=COMBINE_SCHEMA, check=check_combine,
                     check_values=check_combine_values, fake=fake_combine)
dispatch = define(GENERIC_NAMESPACE, DISPATCH)
experts_rows = define(GENERIC_NAMESPACE, EXPERTS_ROWS)
combine = define(GENERIC_NAMESPACE, COMBINE)
