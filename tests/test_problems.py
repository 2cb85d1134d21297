"""`problem_of` reads each op's arguments by their schema names (`named_args`), not by
position: the same call with the schema's arguments in another order poses the same
`Problem`, so a schema that gains or moves an argument cannot shift what is read.
"""

from __future__ import annotations

import pytest
import torch

from torch_moe_ops.backends import problems
from torch_moe_ops.ops import CONTRACTS, GENERIC_NAMESPACE, op_overload
from torch_moe_ops.ops.library import named_args

# Each generic op again, its arguments in reverse order (defaults dropped: every test
# call passes them all), in a namespace of its own.
REORDERED_NAMESPACE = "moe_test_reordered"
# Arguments whose values must make sense together (E divisible by ep_size, a quantization
# format the op takes, ep_size > 1 so that every expert-parallel size is read).
VALUES = {"num_experts": 8, "ep_size": 2, "top_k": 2, "scoring": "softmax",
          "renormalize": True, "activation": "silu", "weight_format": "fp8_block",
          "activation_format": "fp8_group", "block_size": [128, 128], "group_name": "ep",
          "out_dtype": torch.bfloat16}


def _reversed_arguments(schema: str) -> list[str]:
    arguments = schema[schema.index("(") + 1:schema.index(") ->")].split(", ")
    return [argument.split("=")[0] for argument in reversed(arguments)]


@pytest.fixture(scope="module")
def reordered_ops():
    library = torch.library.Library(REORDERED_NAMESPACE, "FRAGMENT")
    for name, contract in CONTRACTS.items():
        library.define(f"{name}({', '.join(_reversed_arguments(contract.schema))}) -> Tensor")
    # The ops live as long as the library object: the module's tests.
    yield library


def sample_args(op_name: str) -> tuple:
    """Arguments of ``moe::<op_name>`` in schema order: each tensor of its own shape
    (``[i + 2, i + 3, i + 4]`` for the i-th argument, on the meta device), other values
    from `VALUES` or distinct per position."""
    args = []
    for i, argument in enumerate(op_overload(GENERIC_NAMESPACE, op_name)._schema.arguments):
        if argument.name in VALUES:
            args.append(VALUES[argument.name])
        elif isinstance(argument.type, (torch.TensorType, torch.OptionalType)):
            args.append(torch.empty((i + 2, i + 3, i + 4), device="meta"))
        elif isinstance(argument.type, torch.IntType):
            args.append(i + 3)
        else:
            args.append(i + 0.5)
    return tuple(args)


@pytest.mark.parametrize("op_name", list(CONTRACTS))
def test_problem_is_read_by_argument_name(op_name, reordered_ops, monkeypatch):
    args = sample_args(op_name)
    expected = problems.problem_of(op_name, args)
    monkeypatch.setattr(problems, "op_overload",
                        lambda _namespace, name: op_overload(REORDERED_NAMESPACE, name))
    assert problems.problem_of(op_name, args[::-1]) == expected


def test_named_args_fills_defaults_and_keywords():
    hidden_TH, weights_TK = torch.empty(3, 8), torch.empty(3, 2)
    ids_TK = torch.zeros(3, 2, dtype=torch.int32)
    named = named_args(torch.ops.moe.dispatch.default, (hidden_TH, weights_TK, ids_TK, 4),
                       {"max_tokens_per_rank": 5})
    assert list(named) == [argument.name for argument in
                           torch.ops.moe.dispatch.default._schema.arguments]
    assert named["hidden"] is hidden_TH and named["topk_ids"] is ids_TK
    assert (named["num_experts"], named["ep_size"], named["group_name"],
            named["max_tokens_per_rank"], named["capacity"]) == (4, 1, "", 5, 0)
