"""Rewrite generic ``moe::*`` nodes of an FX graph to concrete backend ops.

Each generic op becomes the chosen backend's op of the same name, with one
exception, decided per layer by its plan's dispatch dtype (`plan.LayerPlan.dispatch`, the
rule of `torch_moe_ops.backends.dispatch_dtype`): where a quantized layer's rows
travel in fp8, ``moe::dispatch -> moe::experts_rows_quant(x_rows, None, ...)``
becomes the a2a backend's ``dispatch_quant`` (quantize each token, send fp8
rows and their scales) feeding ``experts_rows_quant(x_rows, x_scale, ...,
out_dtype=<activation dtype>)``: the conversion is in the lowered graph, by name.

Each layer is planned once (`plan.plan_layer`: its backends and the format between
dispatch and combine). A layer whose plan takes the tokens format is lowered whole:
``moe::dispatch -> moe::experts_rows -> moe::combine`` becomes the a2a backend's
``dispatch_tokens``, the experts backend's ``experts`` (``experts_quant`` for a quantized
layer whose rows would travel unquantized) on the receive buffers (tokens with local expert
ids, `torch_moe_ops.ops.tokens`) and the a2a backend's ``combine_tokens``: no rows, no copy
into them, and every op in the graph by name. A layer whose plan takes the
masked format is lowered the same way, to ``dispatch_masked``, the experts backend's
``experts_masked`` on the per-expert blocks as they arrived, and ``combine_masked``, which
takes the routing weights (`torch_moe_ops.ops.masked`); a quantized one to
``experts_masked_quant``, after ``dispatch_masked_quant`` where its blocks travel in fp8
(their scales handed to the experts, which return the activation dtype). A tokens layer
whose plan takes chunks (`plan.choose_chunks`) becomes its chunks' ops instead, ordered so
that transfers run under expert compute (`overlap.lower_in_chunks`).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch import fx

from torch_moe_ops import torch_compat
from torch_moe_ops.backends.dispatch_dtype import DispatchDtype
from torch_moe_ops.backends.problems import problem_of
from torch_moe_ops.backends.registry import (
    A2A_OPS,
    EXPERTS_OPS,
    MASKED,
    QUANT_A2A_OPS,
    QUANT_EXPERTS_OPS,
    ROWS,
    TOKENS,
    Problem,
)
from torch_moe_ops.config import BackendSpec
from torch_moe_ops.lowering.graph_values import fake_value, meta_key
from torch_moe_ops.lowering.overlap import chunk_tokens, has_independent_work, lower_in_chunks
from torch_moe_ops.lowering.plan import LayerPlan, plan_layer
from torch_moe_ops.ops import GENERIC_NAMESPACE
from torch_moe_ops.ops.library import full_args, named_args, op_overload, output_index

# The ops that carry a layer's activations: they decide (and must agree on) its backends.
ACTIVATION_OPS = EXPERTS_OPS + QUANT_EXPERTS_OPS + A2A_OPS + QUANT_A2A_OPS


def _op_name(target: object) -> tuple[str, str] | None:
    """``(namespace, name)`` of a custom-op call target, else None."""
    if isinstance(target, torch_compat.OpOverload):
        qualified = target.name()
    elif isinstance(target, torch_compat.OpOverloadPacket):
        qualified = torch_compat.packet_name(target)
    else:
        return None
    namespace, _, name = qualified.partition("::")
    return namespace, name.split(".")[0]


def _example_args(node: fx.Node) -> tuple:
    """The node's arguments in schema order, tensors as their fake values."""
    args = tuple(fake_value(a) for a in node.args)
    kwargs = {k: fake_value(v) for k, v in node.kwargs.items()}
    if not isinstance(args[0], torch.Tensor):
        raise TypeError(f"cannot lower {node.format_node()}: its first input carries no "
                        "tensor metadata (was the graph traced by Dynamo?)")
    return full_args(_target_op(node), args, kwargs)


def generic_op(node: fx.Node) -> str | None:
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
        name = generic_op(node)
        if name is None:
            continue
        problems[node] = problem_of(name, _example_args(node))
        output = fake_value(node)
        if name in EXPERTS_OPS and isinstance(output, torch.Tensor) and output.requires_grad:
            problems[node] = dataclasses.replace(problems[node], training=True)
        layer_of[node] = node
        if name in ACTIVATION_OPS:
            for arg in node.all_input_nodes:
                producer = _producer(arg)
                if producer in layer_of and generic_op(producer) != "route":
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


def layer_plans(gm: fx.GraphModule, spec: BackendSpec) -> dict[fx.Node, LayerPlan]:
    """Each generic op node's `LayerPlan` under ``spec``: one plan per layer (and device),
    shared by its nodes."""
    plans, nodes = {}, {}
    for node, problem in layer_problems(gm).items():
        device = fake_value(node.args[0]).device
        routing = generic_op(node) not in ACTIVATION_OPS
        key = (problem, device, routing)
        if key not in plans:
            # Routing runs on fp32 logits: only the ops that carry activations decide (and
            # must agree on) the experts and a2a backends.
            plans[key] = plan_layer(spec, problem, device, routing)
        nodes[node] = plans[key]
    return nodes


def _lower_graph(gm: fx.GraphModule, spec: BackendSpec) -> None:
    """`lower` on the nodes of ``gm``'s own graph (not those of its submodules)."""
    plans = layer_plans(gm, spec)
    for node, plan in plans.items():
        if generic_op(node) == "dispatch" and plan.a2a.prepare is not None:
            # The transport's state for the size it moves: each chunk's M where chunked.
            sent = named_args(_target_op(node), _example_args(node))
            plan.a2a.prepare(plan.format, plan.mode, *(sent[name] for name in _PREPARED_BY),
                             chunk_tokens(sent["max_tokens_per_rank"], plan.chunks))
    chains = _lower_chains(gm, plans)
    changed = bool(chains)
    for node, plan in plans.items():
        if node in chains:
            continue
        name = generic_op(node)
        namespace = plan.namespace_for(name)
        changed = True
        if name == "dispatch":
            # Per layer, in the node: no process state, so models may differ.
            node.meta["moe_dispatch_dtype"] = plan.dispatch
            if plan.dispatch.dtype != plan.problem.dtype:
                readers = _quantized_readers(node)
                if readers is not None:
                    _send_quantized(gm, node, readers, namespace, plan.problem)
                    continue
                # A graph of the user's own, not the plan: its fp8 rows would reach ops
                # that read the activation dtype.
                node.meta["moe_dispatch_dtype"] = DispatchDtype(plan.problem.dtype, _ROWS_READ)
        packet = getattr(getattr(torch.ops, namespace), name)
        node.target = packet.default if isinstance(node.target, torch_compat.OpOverload) else packet
    if changed:
        gm.graph.lint()
        gm.recompile()


def _rows_chain(dispatch: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(experts_rows, combine)`` where ``dispatch``'s outputs feed one ``moe::experts_rows``
    (or ``moe::experts_rows_quant`` of unquantized rows) and the ``moe::combine`` of its
    output and nothing else (as a layer emits them)."""
    items = list(dispatch.users)
    if any(item.target is not operator.getitem for item in items):
        return None
    readers = {reader for item in items for reader in item.users}
    experts = [r for r in readers if generic_op(r) in ("experts_rows", "experts_rows_quant")]
    combine = [r for r in readers if generic_op(r) == "combine"]
    if len(experts) != 1 or len(combine) != 1 or len(readers) != 2:
        return None
    (experts,), (combine,) = experts, combine
    output = {item: item.args[1] for item in items}
    rows, back = _node_args(experts), _node_args(combine)
    # Rows read unquantized: no scales in, the experts' own dtype out.
    if rows.get("x_scale") is not None or rows.get("out_dtype") is not None:
        return None
    # Each of the dispatch's outputs reaches the argument of the same name.
    sent = output_index(_target_op(dispatch))
    read = {name: (rows if name in rows else back)[name] for name in sent}
    if (any(output.get(value) != sent[name] for name, value in read.items())
            or back["y_rows"] is not experts or set(experts.users) != {combine}):
        return None
    return experts, combine


def _retarget(node: fx.Node, op: torch_compat.OpOverload, args: tuple) -> None:
    """``node`` calls ``op`` on ``args``, its fake value recomputed in the graph's fake mode."""
    node.target, node.args, node.kwargs = op, args, {}
    values = [fake_value(a) for a in args]
    with values[0].fake_mode:
        node.meta[meta_key(node)] = op(*values)


def _lower_chains(gm: fx.GraphModule, plans: dict[fx.Node, LayerPlan]) -> set[fx.Node]:
    """Lower each layer whose plan takes the tokens or the masked format as that format's
    chain; returns the generic nodes that took the chain's ops."""
    lowered: set[fx.Node] = set()
    for dispatch, plan in plans.items():
        if generic_op(dispatch) != "dispatch" or plan.format not in _CHAINS:
            continue
        chain = _rows_chain(dispatch)
        if chain is None:
            raise ValueError(f"cannot lower {dispatch.format_node()} to the {plan.format} "
                             "format: its outputs must feed one moe::experts_rows and the "
                             "moe::combine of its result, and nothing else (as MoE emits them)")
        experts, combine = chain
        sent_args = _node_args(dispatch)
        hidden, topk_weights, topk_ids, num_experts = (
            sent_args[name] for name in ("hidden", "topk_weights", "topk_ids", "num_experts"))
        ep_args = tuple(sent_args[name] for name in _EP_ARGS)
        items = list(dispatch.users)
        quant = plan.problem.quant
        fmt = plan.format
        # The namespace that moves this layer (a layer that trains, or a mode of the
        # transport's engine, may take another).
        namespace = plan.namespace_for(fmt.dispatch)
        # A format with a quantized dispatch of its own (masked) sends its blocks in fp8 where
        # the plan says so (`plan.dispatch_sides`); tokens never do.
        fp8 = plan.dispatch.dtype != plan.problem.dtype
        quant_args = (quant.weights, quant.activations, quant.block_list) if fp8 else ()
        dispatch.meta["moe_dispatch_dtype"] = plan.dispatch
        lowered |= {dispatch, experts, combine}
        # The experts' arguments after the format's inputs: the weights, the activation.
        rows = _node_args(experts)
        names = list(rows)
        weight_args = tuple(rows[name] for name in names[names.index("w13"):]
                            if name != "out_dtype")
        format_experts = op_overload(plan.experts.namespace, fmt.experts_op(quant is not None))
        if plan.chunks > 1 or (plan.in_flight and has_independent_work(combine)):
            lower_in_chunks(gm, (dispatch, experts, combine),
                            (hidden, topk_weights, topk_ids, num_experts, *ep_args),
                            namespace, format_experts, weight_args, plan.chunks)
            continue
        # The dispatch node becomes the format's dispatch; its outputs, new getitems.
        sent_by = fmt.quantized_dispatch if fp8 else fmt.dispatch
        _retarget(dispatch, op_overload(namespace, sent_by),
                  (hidden, topk_weights, topk_ids, num_experts, *quant_args, *ep_args))
        with gm.graph.inserting_after(dispatch):
            sent = [gm.graph.call_function(operator.getitem, (dispatch, i))
                    for i in range(len(fake_value(dispatch)))]
        for item, value in zip(sent, fake_value(dispatch)):
            item.meta[meta_key(dispatch)] = value
        # The dispatch's outputs by name, and the layer's routing beside them.
        values = dict(zip(output_index(_target_op(dispatch)), sent),
                      topk_weights=topk_weights, topk_ids=topk_ids)
        experts_inputs, combine_inputs = (tuple(values[name] for name in names)
                                          for names in _CHAINS[fmt])
        if quant is not None and fmt is MASKED:
            # experts_masked_quant(x, x_scale, count, weights..., out_dtype): the scales
            # come from a quantized dispatch.
            x_masked, count = experts_inputs
            experts_args = (x_masked, values["x_scale"] if fp8 else None, count, *weight_args,
                            plan.problem.dtype if fp8 else None)
        else:
            # experts / experts_masked, or experts_quant, which quantizes the tokens inside.
            experts_args = (*experts_inputs, *weight_args)
        _retarget(experts, format_experts, experts_args)
        _retarget(combine, op_overload(namespace, fmt.combine),
                  (experts, *combine_inputs, num_experts, *ep_args))
        for item in items:
            gm.graph.erase_node(item)
    return lowered


# Per format, by the names of its dispatch's outputs and of the layer's routing: the inputs
# of its experts op before the weights, and those of its combine between the experts'
# output and E.
_CHAINS = {
    TOKENS: (("x_tokens", "topk_weights_tokens", "topk_ids_tokens"), ("topk_ids",)),
    MASKED: (("x_masked", "count_experts"),
             ("src_info", "layout_range", "topk_weights", "topk_ids")),
}


# The expert-parallel arguments every dispatch and combine ends with, in schema order.
_EP_ARGS = ("ep_size", "group_name", "max_tokens_per_rank")
# The dispatch's arguments a transport's `prepare` takes before the tokens it moves.
_PREPARED_BY = ("hidden", "topk_weights", "topk_ids", "num_experts", "ep_size", "group_name")


def _target_op(node: fx.Node) -> torch_compat.OpOverload:
    """The op overload ``node`` calls (a packet's default)."""
    target = node.target
    return target if isinstance(target, torch_compat.OpOverload) else target.default


def _node_args(node: fx.Node) -> dict[str, object]:
    """``node``'s arguments (nodes and constants) by schema name, defaults filled in."""
    return named_args(_target_op(node), node.args, node.kwargs)


def _quantized_readers(dispatch: fx.Node) -> list[fx.Node] | None:
    """The ``moe::experts_rows_quant`` nodes that read ``dispatch``'s ``x_rows``
    unquantized (``x_scale`` and ``out_dtype`` None): those that can read fp8 rows
    and scales instead. None where ``x_rows`` reaches anything else, or nothing."""
    readers = []
    x_rows = output_index(_target_op(dispatch))["x_rows"]
    for item in dispatch.users:
        if item.target is not operator.getitem:
            return None
        if item.args[1] != x_rows:
            continue
        for reader in item.users:
            if generic_op(reader) != "experts_rows_quant":
                return None
            args = _node_args(reader)
            if (args["x_rows"] is not item or args["x_scale"] is not None
                    or args["out_dtype"] is not None):
                return None
            readers.append(reader)
    return readers or None


# Why a dispatch whose plan sends fp8 rows sends them unquantized after all.
_ROWS_READ = ("x_rows reach ops besides moe::experts_rows_quant, which read the activation "
              "dtype: unquantized")


def _send_quantized(gm: fx.GraphModule, dispatch: fx.Node, readers: list[fx.Node],
                    namespace: str, problem: Problem) -> None:
    """``dispatch`` becomes ``namespace::dispatch_quant`` (its six outputs, then
    ``x_scale``), and each of ``readers`` reads its fp8 ``x_rows`` with ``x_scale``,
    returning the activation dtype."""
    quant = problem.quant
    op = op_overload(namespace, ROWS.quantized_dispatch)
    # dispatch_quant: dispatch's arguments, the quantization's among them.
    args = {**_node_args(dispatch), "weight_format": quant.weights,
            "activation_format": quant.activations, "block_size": quant.block_list}
    dispatch.target = op
    dispatch.args = tuple(args[argument.name]
                          for argument in torch_compat.schema(op).arguments)
    dispatch.kwargs = {}
    hidden = args["hidden"]
    values = [fake_value(a) for a in dispatch.args]
    # The mode of the graph's own fake values (the backend may run inside another).
    with fake_value(hidden).fake_mode:
        outputs = op(*values)
    key = meta_key(dispatch)
    dispatch.meta[key] = outputs
    for item in dispatch.users:
        item.meta[key] = outputs[item.args[1]]
    with gm.graph.inserting_after(dispatch):
        x_scale = gm.graph.call_function(operator.getitem, (dispatch, len(outputs) - 1))
    x_scale.meta[key] = outputs[-1]
    for reader in readers:
        reader.args = tuple({**_node_args(reader), "x_scale": x_scale,
                             "out_dtype": problem.dtype}.values())
        reader.kwargs = {}


def expert_parallel(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` or a graph it holds moves tokens between ranks (an op of a
    layer with ``ep_size > 1``)."""
    return any((problem.ep_size or 1) > 1 for body in gm.modules()
               if isinstance(body, fx.GraphModule)
               for problem in layer_problems(body).values())


def in_flight(gm: fx.GraphModule) -> bool:
    """Whether lowered ``gm`` or a graph it holds issues a transfer apart from its wait
    (`overlap.lower_in_chunks`: a ``dispatch_tokens_start`` op)."""
    return any(node.op == "call_function"
               and (_op_name(node.target) or ("", ""))[1] == "dispatch_tokens_start"
               for body in gm.modules() if isinstance(body, fx.GraphModule)
               for node in body.graph.nodes)


def moe_op_sequence(gm: fx.GraphModule) -> str:
    """The custom ops ``gm`` calls, one per line, in graph order (for pinning in tests)."""
    lines = []
    for node in gm.graph.nodes:
        op = _op_name(node.target) if node.op == "call_function" else None
        if op is not None and op[0].startswith(GENERIC_NAMESPACE):
            lines.append("::".join(op))
    return "\n".join(lines)
