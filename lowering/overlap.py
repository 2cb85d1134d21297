"""A layer's tokens chain with its transfers in flight: under the work that does not need the
routed tokens, and in chunks, under expert compute.

Where a layer's plan has its transfers in flight (`plan.choose_in_flight`: at prefill sizes,
where the graph holds work that needs none of the layer's routed tokens, such as its shared
experts) or takes C > 1 chunks (`plan.choose_chunks`, asked for), its ``moe::dispatch ->
moe::experts_rows -> moe::combine`` becomes, per chunk i (a window of M / C of this rank's
tokens, `ops.tokens_in_flight`), the a2a backend's ``dispatch_tokens_start`` (D_i: issue),
``wait_tensor`` and ``dispatch_tokens_finish`` (W_i: wait), the experts backend's op (X_i),
``combine_tokens_start`` (B_i: issue) and ``wait_tensor`` with ``combine_tokens_finish``
(R_i: wait), placed in the graph as a software pipeline::

    D_0 W_0 | D_1 X_0 B_0 W_1 | D_2 X_1 B_1 R_0 W_2 | ... | X_{C-1} B_{C-1} R_{C-2} | R_{C-1}

chunk i + 1's dispatch is issued before chunk i's experts and waited after them, and chunk i's
combine is issued before chunk i + 1's experts and waited after them. The work after the
layer that needs nothing of it (`hoist_independent_work`: a shared expert) moves under the
transfers: its first half (by the weights its linear layers read) between D_0 and W_0, the
rest between B_{C-1} and R_{C-1}, under the last combine, which nothing else hides. Traced,
each issue op becomes its packing and the functional collectives
(``_c10d_functional.all_to_all_single``, ...) and each wait the functional collectives' own
``wait_tensor``: AOTAutograd and Inductor keep them where the graph puts them (Inductor
moves collectives only in passes that are off here: peak-memory reordering, for graphs that
move tokens, `compile.MoECompileBackend`, and compute-comm reordering, by default; its
locality pass, which would move the work placed under a transfer to just before its first
user, after the wait, is off for graphs with transfers in flight), Inductor
keeps each send buffer until its wait, and nothing needs a Python thread or a host sync, so
the graph captures in a CUDA graph. The chunks' outputs (``[M_c, H]`` each, M_c =
ceil(M / C) tokens of one window) stack to ``[C * M_c, H]``, cut to this rank's T.

The lowering places the collectives rather than leaving them to Inductor's
``reorder_for_compute_comm_overlap``: a transport op that issues and waits inside offers that
pass nothing to move; the pass is Inductor's alone (``aot_eager`` would run unordered); it
chooses by runtime estimates, which custom experts kernels do not give it; and a pass that
moves one rank's collectives past each other differently from another's deadlocks them.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

import torch
from torch import fx

from torch_moe_ops import torch_compat
from torch_moe_ops.backends.common.transport import collectives
from torch_moe_ops.lowering.graph_values import fake_value, meta_key
from torch_moe_ops.ops.library import defines, op_overload


class _Builder:
    """Appends calls before ``anchor``, each node with its fake value under ``key``; ``built``
    lists them."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node, key: str, fake_mode):
        self.graph, self.anchor, self.key, self.fake_mode = graph, anchor, key, fake_mode
        self.built: list[fx.Node] = []

    def call(self, op, *args) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(op, args)
        self.built.append(node)
        with self.fake_mode:
            node.meta[self.key] = op(*fx.node.map_aggregate(args, fake_value))
        return node

    def items(self, node: fx.Node, count: int) -> list[fx.Node]:
        return [self.call(operator.getitem, node, i) for i in range(count)]


def chunk_tokens(max_tokens_per_rank: int, chunks: int) -> int:
    """M of one chunk: the tokens of one rank's window, ``ceil(M / chunks)``."""
    return -(-max_tokens_per_rank // chunks)


def lower_in_chunks(gm: fx.GraphModule, chain: tuple[fx.Node, fx.Node, fx.Node],
                    dispatch_args: tuple, a2a_namespace: str, experts_op, expert_args: tuple,
                    chunks: int) -> None:
    """Replace ``chain``, the generic nodes ``(dispatch, experts, combine)`` of one layer of
    ``gm`` (as `rewrite` finds them), by its ``chunks`` chunks in pipeline order (the module
    docstring). ``dispatch_args``: ``(hidden, topk_weights, topk_ids, num_experts, ep_size,
    group_name, max_tokens_per_rank)``; ``expert_args``: what ``experts_op`` (the experts
    backend's tokens op) takes after the routing."""
    dispatch, experts, combine = chain
    hidden, topk_weights, topk_ids, num_experts, ep_size, group_name, max_tokens = dispatch_args
    ep_args = (num_experts, ep_size, group_name, chunk_tokens(max_tokens, chunks))
    build = _Builder(gm.graph, combine, meta_key(dispatch), fake_value(hidden).fake_mode)

    def op(name):
        return op_overload(a2a_namespace, name)

    def issue_dispatch(chunk):
        started = build.call(op("dispatch_tokens_start"), hidden, topk_weights, topk_ids,
                             *ep_args, chunk, chunks)
        return build.items(started, 2)

    def wait_dispatch(in_flight):
        x_tokens, routing = (build.call(collectives.wait, pending) for pending in in_flight)
        finished = build.call(op("dispatch_tokens_finish"), routing, *ep_args)
        return (x_tokens, *build.items(finished, 2))

    def issue_combine(y_tokens, chunk):
        return build.call(op("combine_tokens_start"), y_tokens, topk_ids, *ep_args, chunk,
                          chunks)

    combine_waits = []

    def wait_combine(in_flight, chunk):
        returned = build.call(collectives.wait, in_flight)
        combine_waits.append(returned)
        if not defines(a2a_namespace, "combine_tokens_finish"):
            return returned
        return build.call(op("combine_tokens_finish"), returned, topk_ids, *ep_args, chunk,
                          chunks)

    outputs, combines = [], []
    received = wait_dispatch(issue_dispatch(0))
    # The first wait: work that needs no routed tokens runs before it, under the transfer.
    first_wait = received[0]
    for chunk in range(chunks):
        if chunk + 1 < chunks:
            in_flight = issue_dispatch(chunk + 1)
        y_tokens = build.call(experts_op, *received, *expert_args)
        combines.append(issue_combine(y_tokens, chunk))
        if chunk > 0:
            outputs.append(wait_combine(combines[chunk - 1], chunk - 1))
        if chunk + 1 < chunks:
            received = wait_dispatch(in_flight)
    outputs.append(wait_combine(combines[-1], chunks - 1))
    stacked = build.call(torch.ops.aten.cat.default, outputs)
    num_tokens = fake_value(topk_ids).shape[0]
    if not isinstance(num_tokens, int):
        num_tokens = build.call(torch.ops.aten.sym_size.int, topk_ids, 0)
    combine.replace_all_uses_with(build.call(torch.ops.aten.slice.Tensor, stacked, 0, 0,
                                             num_tokens))
    items = list(dispatch.users)
    for node in (combine, experts, *items, dispatch):
        gm.graph.erase_node(node)
    hoist_independent_work(first_wait, set(build.built), combine_waits[-1])


# Calls that change what later calls compute (grad mode, autocast): nothing moves past them.
_STATE_CHANGES = ("_set_grad_enabled", "_enter_autocast", "_exit_autocast", "set_grad_enabled")
# Python's operators that write into their first operand (Dynamo records ``x[i] = y`` and
# ``x += y`` on a tensor as these): moved, they would write before a read that came first.
_WRITING_OPERATORS = frozenset((
    operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
    operator.imatmul, operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow,
    operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift))


def _moves_freely(node: fx.Node) -> bool | None:
    """Whether ``node`` may run earlier than the graph has it: a computation with no effect
    but its output (True); an effect of its own (False: it stays, and so does what reads
    it); None for a call that changes state later calls read (nothing moves past it)."""
    target = node.target
    name = getattr(target, "__name__", str(target))
    if node.op not in ("call_function", "call_method"):
        return False
    if name in _STATE_CHANGES:
        return None
    if node.op == "call_method":
        return not name.endswith("_")
    if isinstance(target, (torch_compat.OpOverload, torch_compat.OpOverloadPacket)):
        op = target if isinstance(target, torch_compat.OpOverload) else target.default
        namespace = op.name().partition("::")[0]
        # Ours and the collectives keep their order on every rank.
        return not (namespace.startswith("moe") or "c10d" in namespace
                    or torch_compat.schema(op).is_mutable)
    # In place: a trailing underscore, ``inplace=True``, or a higher-order op that mutates
    # (a user's Triton kernel) or carries effects.
    if (target in _WRITING_OPERATORS or node.kwargs.get("inplace") or "mutation" in name
            or "effects" in name):
        return False
    return not name.endswith("_") or name.startswith("__")


def _independent(first: fx.Node, tainted: set[fx.Node]) -> Iterator[fx.Node]:
    """The nodes from ``first`` on, in graph order, that need nothing of ``tainted`` (directly
    or through another node) and may run earlier (`_moves_freely`, as may all they read
    after ``first``); none past a call that changes state."""
    tainted, stays = set(tainted), set()
    node = first
    while node.op != "output":
        following = node.next
        inputs = set(node.all_input_nodes)
        if inputs & tainted:
            tainted.add(node)
        else:
            free = _moves_freely(node)
            if free is None:
                return
            if free and not inputs & stays:
                yield node
            else:
                stays.add(node)
        node = following


def has_independent_work(combine: fx.Node) -> bool:
    """Whether the graph holds work after a layer's ``combine`` that does not need it (nor
    anything else of its layer, whose other nodes feed it): what `lower_in_chunks` runs
    under the layer's transfer."""
    return next(_independent(combine.next, {combine}), None) is not None


def _weight_elements(node: fx.Node) -> int:
    """A linear layer's weight elements (its multiply-adds per token), else 0."""
    if node.op != "call_function" or node.target not in torch_compat.linear_targets:
        return 0
    weight = fake_value(node.args[1] if len(node.args) > 1 else node.kwargs.get("weight"))
    return weight.numel() if isinstance(weight, torch.Tensor) else 0


def hoist_independent_work(wait: fx.Node, in_flight: set[fx.Node],
                           last_wait: fx.Node | None = None) -> None:
    """Move the nodes after ``wait`` (a layer's first wait for its transfer) that need
    nothing of ``in_flight`` (the layer's transport and experts nodes) to just before it, in
    their order: the block's work that does not need the routed tokens (its shared experts)
    then runs while the tokens travel.

    With ``last_wait`` (the wait for the layer's last combine) that work is split in two, in
    order, at the linear layer where half of its weights (`_weight_elements`) have been
    read: the first part runs under the dispatch, the rest (a shared expert's activation and
    down projection) just before ``last_wait``, under the combine, which would otherwise
    have nothing beside it."""
    work = list(_independent(wait.next, in_flight))
    weights = [_weight_elements(node) for node in work]
    total = sum(weights)
    split, done = len(work), 0
    if last_wait is not None and total:
        for position, elements in enumerate(weights):
            done += elements
            if 2 * done >= total:
                split = position + 1
                break
    for node in work[:split]:
        wait.prepend(node)
    for node in work[split:]:
        last_wait.prepend(node)
