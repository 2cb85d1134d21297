"""Rewrite generic ``moe::*`` nodes of an FX graph to concrete backend ops."""

from __future__ import annotations

import operator

import torch
from torch import fx

from torch_moe_ops.backends import namespace_for
from torch_moe_ops.backends.dispatch_dtype import resolve_dispatch_dtype
from torch_moe_ops.backends.problems import problem_of
from torch_moe_ops.backends.registry import (
    A2A_OPS,
    EXPERTS_OPS,
    QUANT_EXPERTS_OPS,
    REGISTRY,
    ExpertsBackend,
    Problem,
)
from torch_moe_ops.config import BackendSpec
from torch_moe_ops.ops import GENERIC_NAMESPACE
from torch_moe_ops.ops.library import full_args


def _op_name(target: object) -> tuple[str, str] | None:
    """``(namespace, name)`` of a custom-op call target, else None."""
    if isinstance(target, torch._ops.OpOverload):
        qualified = target.name()
    elif isinstance(target, torch._ops.OpOverloadPacket):
        qualified = target._qualified_op_name
    else:
        return None
    namespace, _, name = qualified.partition("::")
    return namespace, name.split(".")[0]


def _value(arg: object) -> object:
    if isinstance(arg, fx.Node):
        return arg.meta.get("val", arg.meta.get("example_value"))
    return arg


def _example_args(node: fx.Node) -> tuple:
    """The node's arguments in schema order, tensors as their fake values."""
    args = tuple(_value(a) for a in node.args)
    kwargs = {k: _value(v) for k, v in node.kwargs.items()}
    if not isinstance(args[0], torch.Tensor):
        raise TypeError(f"cannot lower {node.format_node()}: its first input carries no "
                        "tensor metadata (was the graph traced by Dynamo?)")
    target = node.target
    return full_args(target if isinstance(target, torch._ops.OpOverload) else target.default,
                     args, kwargs)


def check_combination(spec: BackendSpec, device: torch.device,
                      problem: Problem) -> ExpertsBackend:
    """The a2a backend's output layout must be what the experts backend consumes;
    returns that experts backend."""
    a2a = REGISTRY.choose_a2a(spec, problem, device)
    experts = REGISTRY.choose_experts(spec, problem, device)
    if a2a.layout != experts.layout:
        raise ValueError(f"a2a backend {a2a.name!r} produces the {a2a.layout!r} layout but "
                         f"experts backend {experts.name!r} consumes {experts.layout!r}, and "
                         "no adapter between them is registered")
    return experts


def _generic_op(node: fx.Node) -> str | None:
    """The name of the generic ``moe::*`` op ``node`` calls, else None."""
    op = _op_name(node.target) if node.op == "call_function" else None
    return op[1] if op is not None and op[0] == GENERIC_NAMESPACE else None


def _producer(arg: object) -> fx.Node | None:
    """The node whose output ``arg`` is, looking through tuple indexing."""
    if isinstance(arg, fx.Node) and arg.op == "call_function" and arg.target is operator.getitem:
        arg = arg.args[0]
    return arg if isinstance(arg, fx.Node) else None


def layer_problems(gm: fx.GraphModule) -> dict[fx.Node, Problem]:
    """Each generic op node's `Problem`, completed with what the other ops of its
    layer know: ``dispatch`` knows E, the expert-parallel sizes and K,
    ``experts_rows`` the weights' sizes and the activation; every backend of the
    layer decides on all of it. Ops of one layer are those joined by data flow."""
    problems, layer_of = {}, {}
    for node in gm.graph.nodes:
        name = _generic_op(node)
        if name is None:
            continue
        problems[node] = problem_of(name, _example_args(node))
        layer_of[node] = node
        if name in EXPERTS_OPS + QUANT_EXPERTS_OPS + A2A_OPS:
            for arg in node.all_input_nodes:
                producer = _producer(arg)
                if producer in layer_of and _generic_op(producer) != "route":
                    layer_of[node] = layer_of[producer]
    merged: dict[fx.Node, Problem] = {}
    for node, root in layer_of.items():
        merged[root] = merged[root].merged(problems[node]) if root in merged else problems[node]
    return {node: merged[root] for node, root in layer_of.items()}


def lower(gm: fx.GraphModule, spec: BackendSpec) -> fx.GraphModule:
    """Point every generic ``moe::*`` call in ``gm`` at the backend ``spec`` chooses.

    The choice is made per node from its device and its layer's `Problem` (sizes,
    dtype, activation, expert-parallel layout, read from the graph), so a graph
    that mixes devices gets each device's backend, and a backend that cannot run
    a layer fails here, with its reason, not when the model runs. A graph with no
    MoE op is returned untouched. Raises ValueError for an unregistered,
    unavailable or inconsistent choice.

    The bodies of higher-order ops (a region under ``torch.utils.checkpoint``,
    ...) are graphs of their own, held as submodules of ``gm``: they are lowered
    too, or their ops would run the eager default whatever ``spec`` says.
    """
    for body in gm.modules():
        if isinstance(body, fx.GraphModule):
            _lower_graph(body, spec)
    return gm


def _lower_graph(gm: fx.GraphModule, spec: BackendSpec) -> None:
    """`lower` on the nodes of ``gm``'s own graph (not those of its submodules)."""
    changed = False
    problems = layer_problems(gm)
    for node, problem in problems.items():
        op = (GENERIC_NAMESPACE, _generic_op(node))
        # layer_problems checked that the first argument carries a tensor.
        device = _value(node.args[0]).device
        # Routing runs on fp32 logits: only the ops that carry activations decide
        # (and must agree on) the experts and a2a backends.
        if op[1] in EXPERTS_OPS + QUANT_EXPERTS_OPS + A2A_OPS:
            experts = check_combination(spec, device, problem)
        namespace = namespace_for(op[1], spec, device, problem)
        if op[1] == "dispatch":
            # Per layer, in the node: no process state, so models may differ.
            node.meta["moe_dispatch_dtype"] = resolve_dispatch_dtype(
                problem.dtype, spec.dispatch_dtype, problem.quant, experts.dispatch_dtype,
                repr(experts.name))
        packet = getattr(getattr(torch.ops, namespace), op[1])
        node.target = packet.default if isinstance(node.target, torch._ops.OpOverload) else packet
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


def expert_parallel(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` or a graph it holds moves tokens between ranks (an op of a
    layer with ``ep_size > 1``)."""
    return any((problem.ep_size or 1) > 1 for body in gm.modules()
               if isinstance(body, fx.GraphModule)
               for problem in layer_problems(body).values())


def moe_op_sequence(gm: fx.GraphModule) -> str:
    """The custom ops ``gm`` calls, one per line, in graph order (for pinning in tests)."""
    lines = []
    for node in gm.graph.nodes:
        op = _op_name(node.target) if node.op == "call_function" else None
        if op is not None and op[0].startswith(GENERIC_NAMESPACE):
            lines.append("::".join(op))
    return "\n".join(lines)
