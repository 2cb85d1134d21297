"""What the nodes of a traced graph hold: their fake values, where Dynamo and make_fx keep
them."""

from __future__ import annotations

from torch import fx


def fake_value(arg: object) -> object:
    """The fake value of ``arg`` where it is a node, else ``arg`` itself (a constant)."""
    if isinstance(arg, fx.Node):
        return arg.meta.get("val", arg.meta.get("example_value"))
    return arg


def meta_key(node: fx.Node) -> str:
    """Where ``node`` keeps its fake value (`fake_value`): Dynamo and make_fx differ."""
    return "val" if "val" in node.meta else "example_value"
