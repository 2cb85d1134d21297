"""README's "The ops" table says what each op takes and returns as the op's
schema does: every argument and every output by its schema name, in order.

A cell is a comma-separated list (commas inside backticks do not count); an
entry's first backticked span starts with the name, then a shape, a default or
``?`` may follow (`` `hidden [T, H]` ``, `` `ep_size=1` ``). An unnamed output
(``-> Tensor``) is written by its shape alone (`` `[T, H]` ``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import torch_moe_ops  # noqa: F401  (defines the ops)
from torch_moe_ops.ops import CONTRACTS

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
SECTION = re.search(r"^## The ops\n(.*?)(?=^## )", README, re.DOTALL | re.MULTILINE).group(1)
# The ops a user calls: each has a row of the table.
TABLE_OPS = ("route", "experts", "dispatch", "experts_rows", "combine", "dispatch_tokens",
             "combine_tokens")


def entry_names(cell: str) -> list[str]:
    """The name each entry of ``cell`` starts with ("" for an entry given by its shape)."""
    entries = re.split(r",\s*(?=(?:[^`]*`[^`]*`)*[^`]*$)", cell.strip())
    names = []
    for entry in entries:
        span = re.search(r"`([^`]*)`", entry)
        assert span, f"entry {entry!r} of {cell!r} has no backticked name or shape"
        names.append(re.match(r"\w*", span.group(1)).group(0))
    return names


def table() -> dict[str, tuple[str, str]]:
    """op name -> (takes cell, returns cell)."""
    rows = {}
    for line in SECTION.splitlines():
        match = re.match(r"\| `moe::(\w+)` \|(.*)\|(.*)\|$", line)
        if match:
            rows[match.group(1)] = (match.group(2), match.group(3))
    return rows


def test_table_has_a_row_per_op():
    assert sorted(table()) == sorted(TABLE_OPS)


@pytest.mark.parametrize("op_name", TABLE_OPS)
def test_row_matches_the_schema(op_name):
    schema = getattr(torch.ops.moe, op_name).default._schema
    takes, returns = table()[op_name]
    assert entry_names(takes) == [argument.name for argument in schema.arguments]
    assert entry_names(returns) == [output.name for output in schema.returns]


def test_section_names_every_generic_op():
    # The ops without a row (gradients, quantized variants) are named in its text.
    missing = [name for name in CONTRACTS if f"`{name}`" not in SECTION
               and f"`moe::{name}`" not in SECTION]
    assert not missing
