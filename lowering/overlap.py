"""A layer's tokens chain in chunks, ordered so that transfers run under expert compute.

Where a layer's plan takes C > 1 chunks (`plan.choose_chunks`), its ``moe::dispatch ->
moe::experts_rows -> moe::combine`` becomes, per chunk i (a window of M / C of this rank's
tokens, `ops.tokens_in_flight`), the a2a backend's ``dispatch_tokens_start`` (D_i: issue),
``wait_tensor`` and ``dispatch_tokens_finish`` (W_i: wait), the experts backend's op (X_i),
``combine_tokens_start`` (B_i: issue) and ``wait_tensor`` with ``combine_tokens_finish``
(R_i: wait), placed in the graph as a software pipeline::

    D_0 W_0 | D_1 X_0 B_0 W_1 | D_2 X_1 B_1 R_0 W_2 | ... | X_{C-1} B_{C-1} R_{C-2} | R_{C-1}

chunk i + 1's dispatch is issued before chunk i's experts and waited after them, and chunk i's
combine is issued before chunk i + 1's experts and waited after them. Traced, each issue op
becomes its packing and the functional collectives (``_c10d_functional.all_to_all_single``,
...) and each wait the functional collectives' own ``wait_tensor``: AOTAutograd and Inductor
keep them where the graph puts them (Inductor moves collectives only in passes that are off
here: peak-memory reordering, for graphs that move tokens, `compile.MoECompileBackend`, and
compute-comm reordering, by default), Inductor keeps each send buffer until its wait, and
nothing needs a Python thread or a host sync, so the graph captures in a CUDA graph. The
chunks' outputs (``[M_c, H]`` each, M_c = ceil(M / C) tokens of one window) stack to
``[C * M_c, H]``, cut to this rank's T.

The lowering places the collectives rather than leaving them to Inductor's
``reorder_for_compute_comm_overlap``: a transport op that issues and waits inside offers that
pass nothing to move; the pass is Inductor's alone (``aot_eager`` would run unordered); it
chooses by runtime estimates, which custom experts kernels do not give it; and a pass that
moves one rank's collectives past each other differently from another's deadlocks them.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from torch_moe_ops.backends.common.transport import collectives
from torch_moe_ops.lowering.graph_values import fake_value, meta_key
from torch_moe_ops.ops.library import defines, op_overload


class _Builder:
    """Appends calls before ``anchor``, each node with its fake value under ``key``."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node, key: str, fake_mode):
        self.graph, self.anchor, self.key, self.fake_mode = graph, anchor, key, fake_mode

    def call(self, op, *args) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(op, args)
        with self.fake_mode:
            node.meta[self.key] = op(*fx.node.map_aggregate(args, fake_value))
        return node

    def items(self, node: fx.Node, count: int) -> list[fx.Node]:
        return [self.call(operator.getitem, node, i) for i in range(count)]


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
    chunk_tokens = -(-max_tokens // chunks)
    ep_args = (num_experts, ep_size, group_name, chunk_tokens)
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

    def wait_combine(in_flight, chunk):
        returned = build.call(collectives.wait, in_flight)
        if not defines(a2a_namespace, "combine_tokens_finish"):
            return returned
        return build.call(op("combine_tokens_finish"), returned, topk_ids, *ep_args, chunk,
                          chunks)

    outputs, combines = [], []
    received = wait_dispatch(issue_dispatch(0))
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
