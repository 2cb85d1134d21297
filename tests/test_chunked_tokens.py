"""A compiled expert-parallel layer whose tokens move in chunks (`ops.tokens_in_flight`,
`lowering.overlap`) over torch.distributed (gloo, CPU processes): it equals the same layer
moved whole and the single-process layer, whatever the chunk count against the tokens (an
idle rank, uneven counts, T not a multiple of the chunks, T below them, a symbolic T); its
lowered graph issues chunk 2's dispatch before chunk 1's experts and waits for it after
them, so do the graph AOTAutograd hands the inner compiler and the code Inductor
generates; and `tmo.explain` says how many chunks and why.

Legend: T tokens of one rank, N tokens of all ranks, H hidden size, I expert intermediate
size, E experts, K experts per token, M max_tokens_per_rank.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.utils import run_and_get_code

import torch_moe_ops as tmo
from distributed import run_on_ranks
from ep_problems import cpu_single_and_sharded, token_slice
from torch_moe_ops.backends.common.transport import collectives
from torch_moe_ops.lowering import overlap, plan
from torch_moe_ops.lowering.compile import MoECompileBackend
from torch_moe_ops.lowering.rewrite import lower

H, I, K = 16, 8, 3
MAX_TOKENS = 7
# Tokens on each rank: uneven, one rank idle, 3 tokens below 4 chunks, 5 and 6 no multiple
# of the chunks' M (4, 3 and 2 tokens for 2, 3 and 4 chunks).
TOKENS_PER_RANK = {2: (5, 0), 3: (6, 0, 3)}
CHUNKS = (2, 3, 4)
INNERS = {2: ("aot_eager", "inductor"), 3: ("aot_eager",)}
# Calls of one graph with T marked dynamic: T >= 2 on every rank (sizes 0 and 1 specialize,
# and a rank whose graph differs would run other collectives).
# The functional collectives that issue the chunks' transfers.
ISSUES = ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor")
DYNAMIC_TOKENS = {2: ((5, 2), (7, 3), (2, 6)), 3: ((6, 2, 3), (3, 7, 2), (2, 4, 5))}


def _layers():
    # No sizes remembered from another case's calls: a rank whose T turned symbolic would run
    # other collectives than one whose T (0 or 1) stays static.
    torch._dynamo.reset()
    return cpu_single_and_sharded(H, I, K, MAX_TOKENS)


def _tokens(rank: int, world_size: int):
    x_NH = torch.randn(sum(TOKENS_PER_RANK[world_size]), H,
                       generator=torch.Generator().manual_seed(9))
    return x_NH, token_slice(TOKENS_PER_RANK[world_size], rank)


def _compiled(layer, a2a: str, chunks: int, inner: str):
    torch._dynamo.reset()
    return torch.compile(layer, backend=MoECompileBackend(tmo.BackendSpec(a2a=a2a, chunks=chunks),
                                                          inner), fullgraph=True)


def _check_chunked_matches_whole(rank, world_size, a2a):
    single, sharded = _layers()
    x_NH, mine = _tokens(rank, world_size)
    with torch.no_grad():
        expected_TH = single(x_NH)[mine]
        for inner in INNERS[world_size]:
            whole_TH = _compiled(sharded, a2a, 1, inner)(x_NH[mine])
            torch.testing.assert_close(whole_TH, expected_TH, rtol=1e-4, atol=1e-5)
            for chunks in CHUNKS if inner == "aot_eager" else CHUNKS[:1]:
                chunked_TH = _compiled(sharded, a2a, chunks, inner)(x_NH[mine])
                # The same sums per token, each in the same order: equal up to the GEMMs'
                # blocking over fewer rows.
                torch.testing.assert_close(chunked_TH, whole_TH, rtol=1e-5, atol=1e-6)


def _check_symbolic_token_count(rank, world_size, a2a):
    """One graph serves every T (marked dynamic): the chunks' windows stay inside their ops."""
    single, sharded = _layers()
    compiled = _compiled(sharded, a2a, 2, "aot_eager")
    with torch.no_grad():
        for seed, counts in enumerate(DYNAMIC_TOKENS[world_size]):
            x_NH = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(seed))
            mine = token_slice(counts, rank)
            x_TH = x_NH[mine].clone()
            torch._dynamo.mark_dynamic(x_TH, 0)
            torch.testing.assert_close(compiled(x_TH), single(x_NH)[mine], rtol=1e-4,
                                       atol=1e-5)


def _position(nodes, node):
    return nodes.index(node)


def _calls(nodes, name: str):
    """The nodes of ``nodes`` that call an op named ``name`` (any namespace)."""
    return [n for n in nodes if isinstance(n.target, torch._ops.OpOverload)
            and n.target.name().partition("::")[2] == name]


def _check_overlap_order(rank, world_size, a2a):
    """Chunk 2's dispatch is issued before chunk 1's experts and waited after them; chunk 1's
    combine is issued before chunk 2's experts and waited after them: in the lowered graph
    and in the forward graph AOTAutograd makes of it."""
    _, sharded = _layers()
    spec = tmo.BackendSpec(a2a=a2a, chunks=2)
    lowered, forward = [], []

    def capture(gm, _example_inputs):
        forward.append(gm)
        return gm

    def recording(gm, example_inputs):
        lowered.append(lower(gm, spec))
        return aot_autograd(fw_compiler=capture)(lowered[0], example_inputs)

    x_NH, mine = _tokens(rank, world_size)
    with torch.no_grad():
        torch.compile(sharded, backend=recording, fullgraph=True)(x_NH[mine])
    nodes = list(lowered[0].graph.nodes)

    def calls(name):
        return _calls(nodes, name)

    experts = calls("experts")
    waits = calls("wait_tensor")
    assert len(experts) == 2, lowered[0].code
    for first, second in (("dispatch_tokens_start", "dispatch_tokens_start"),
                          ("combine_tokens_start", None)):
        if second is not None:
            # Chunk 2's dispatch: issued before chunk 1's experts, waited after them.
            (started,) = [n for n in calls(first) if n.args[-2] == 1]
            in_flight = {item for item in started.users}
            awaited = [w for w in waits if w.args[0] in in_flight]
            assert _position(nodes, started) < _position(nodes, experts[0]), lowered[0].code
            assert len(awaited) == 2 and all(
                _position(nodes, w) > _position(nodes, experts[0]) for w in awaited)
        else:
            # Chunk 1's combine: issued before chunk 2's experts, waited after them.
            (started,) = [n for n in calls(first) if n.args[-2] == 0]
            (awaited,) = [w for w in waits if w.args[0] is started]
            assert (_position(nodes, experts[0]) < _position(nodes, started)
                    < _position(nodes, experts[1]) < _position(nodes, awaited)), lowered[0].code
    # After functionalization: the order of issues, experts and waits holds (four dispatch
    # messages, two combine messages, in that order).
    forward_nodes = list(forward[0].graph.nodes)
    issues = sorted((n for name in ISSUES for n in _calls(forward_nodes, name)),
                    key=forward_nodes.index)
    forward_experts = _calls(forward_nodes, "experts")
    forward_waits = [n for n in forward_nodes if n.target is collectives.wait]
    assert len(issues) == 6 and len(forward_waits) == 6, forward[0].code
    assert len(forward_experts) == 2, forward[0].code
    chunk_two_issued = max(_position(forward_nodes, n) for n in issues[2:4])
    chunk_two_waited = min(_position(forward_nodes, n) for n in forward_waits[2:4])
    assert (chunk_two_issued < _position(forward_nodes, forward_experts[0])
            < chunk_two_waited), forward[0].code


def _check_inductor_keeps_the_order(rank, world_size, a2a):
    """The code Inductor generates calls chunk 2's dispatch collectives before chunk 1's
    experts and waits for them after: its scheduler keeps the order the lowering chose."""
    _, sharded = _layers()
    x_NH, mine = _tokens(rank, world_size)
    with torch.no_grad():
        _, codes = run_and_get_code(_compiled(sharded, a2a, 2, "inductor"), x_NH[mine])
    code = codes[0][codes[0].index("def call("):]

    def calls(text):
        return [i for i in range(len(code)) if code.startswith(text, i)]

    issues = sorted(i for name in ISSUES for i in calls(f"_c10d_functional.{name}.default("))
    waits = calls("wait_tensor.default(")
    experts = calls("experts.default(")
    assert len(issues) == 6 and len(waits) == 6 and len(experts) == 2, code
    assert max(issues[2:4]) < experts[0] < min(waits[2:4]), code
    assert experts[0] < issues[4] < experts[1] < waits[4], code


def _check_explain(rank, world_size, a2a):
    _, sharded = _layers()
    x_NH, mine = _tokens(rank, world_size)
    with torch.no_grad():
        (asked,) = tmo.explain(sharded, x_NH[mine], a2a=a2a, chunks=3)
        (auto,) = tmo.explain(sharded, x_NH[mine], a2a=a2a)
    (training,) = tmo.explain(sharded, x_NH[mine], a2a=a2a, chunks=3)
    assert asked.plan.chunks == 3 and "chunks:  3 (chunks=3 asked)" in str(asked), str(asked)
    # 3 windows of 3 positions for M = 7: fp32 rows of H with K ids and weights, rows back.
    peers, positions = world_size - 1, 3 * 3
    assert (f"dispatch {peers * positions * (4 * H + 8 * K):,}, "
            f"combine {peers * positions * 4 * H:,}") in str(asked), str(asked)
    assert auto.plan.chunks == 1 and "chunks:  1 (none asked" in str(auto), str(auto)
    assert not auto.plan.in_flight and "in flight: no (overlap=False" in str(auto), str(auto)
    assert training.plan.chunks == 1 and "chunks:  1 (training" in str(training), str(training)


def _check_opcheck(rank, world_size, a2a):
    """The chunked ops' fakes match their kernels (chunk 2 of 2: a window past an idle rank's
    tokens and past the end of a rank's). The issuing ops are checked on their schema and
    fake only: the other checks read their outputs, which are in flight."""
    num_experts, chunk_tokens = 2 * world_size, 4
    gen = torch.Generator().manual_seed(rank)
    num_tokens = TOKENS_PER_RANK[world_size][rank]
    hidden_TH = torch.randn(num_tokens, H, generator=gen)
    topk_ids_TK = torch.randint(-1, num_experts, (num_tokens, K), generator=gen,
                                dtype=torch.int32)
    topk_weights_TK = torch.rand(num_tokens, K, generator=gen)
    ep_args = (num_experts, world_size, dist.group.WORLD.group_name, chunk_tokens)
    chunk = (1, 2)
    namespace = {"all_to_all": torch.ops.moe_all_to_all, "allgather": torch.ops.moe_allgather}[a2a]
    issued_only = ("test_schema", "test_faketensor")
    start_args = (hidden_TH, topk_weights_TK, topk_ids_TK, *ep_args, *chunk)
    torch.library.opcheck(namespace.dispatch_tokens_start.default, start_args,
                          test_utils=issued_only)
    x_NH, routing_NX = (collectives.wait(t) for t in
                        namespace.dispatch_tokens_start.default(*start_args))
    torch.library.opcheck(namespace.dispatch_tokens_finish.default, (routing_NX, *ep_args))
    combine_args = (x_NH, topk_ids_TK, *ep_args, *chunk)
    torch.library.opcheck(namespace.combine_tokens_start.default, combine_args,
                          test_utils=issued_only)
    returned = collectives.wait(namespace.combine_tokens_start.default(*combine_args))
    if a2a == "all_to_all":
        torch.library.opcheck(namespace.combine_tokens_finish.default,
                              (returned, topk_ids_TK, *ep_args, *chunk))


def _check_shared_experts_under_the_transfer(rank, world_size, a2a):
    """At prefill sizes, a layer with shared experts issues its dispatch, runs its shared
    experts, and only then waits for the tokens (one chunk: no weights read twice); the
    same output as the single process. At decode sizes it moves whole."""
    world = dist.get_world_size()
    for max_tokens, in_flight in ((plan.IN_FLIGHT_TOKENS, True), (MAX_TOKENS, False)):
        torch._dynamo.reset()
        torch.manual_seed(5)
        cfg = dict(hidden_size=H, intermediate_size=I, num_experts=2 * world, top_k=K,
                   renormalize=True, shared_expert_intermediate_size=8)
        single = tmo.MoE(tmo.MoEConfig(**cfg))
        sharded = tmo.MoE(tmo.MoEConfig(**cfg, ep_size=world, max_tokens_per_rank=max_tokens),
                          ep_group=dist.group.WORLD)
        sharded.load_full_weights(single.state_dict())
        spec = tmo.BackendSpec(a2a=a2a, overlap=True)
        lowered = []

        def recording(gm, example_inputs, spec=spec, lowered=lowered):
            lowered.append(lower(gm, spec))
            return gm.forward

        x_NH, mine = _tokens(rank, world_size)
        with torch.no_grad():
            out_TH = torch.compile(sharded, backend=recording, fullgraph=True)(x_NH[mine])
            torch.testing.assert_close(out_TH, single(x_NH)[mine], rtol=1e-4, atol=1e-5)
        nodes = list(lowered[0].graph.nodes)
        starts = _calls(nodes, "dispatch_tokens_start")
        if not in_flight:
            assert not starts and _calls(nodes, "dispatch_tokens"), lowered[0].code
            continue
        (started,) = starts
        (combine_started,) = _calls(nodes, "combine_tokens_start")
        waits = [_position(nodes, n) for n in nodes if n.target is collectives.wait]
        # The shared experts' two projections: gate and up in one (2/3 of the weights) under
        # the dispatch, then down under the combine.
        gate_up, down = [n for n in nodes if n.op == "call_function" and any(
            a.op == "placeholder" and "shared_experts" in a.name for a in n.all_input_nodes)]
        assert _position(nodes, started) < _position(nodes, gate_up) < min(waits), (
            lowered[0].code)
        assert _position(nodes, combine_started) < _position(nodes, down) < max(waits), (
            lowered[0].code)
        if "inductor" in INNERS[world_size]:
            _check_inductor_keeps_shared_work_in_flight(sharded, x_NH[mine], spec)


def _check_inductor_keeps_shared_work_in_flight(sharded, x_TH, spec):
    """In the code Inductor generates, the shared expert's gate-up GEMM runs between the
    dispatch's issue and its wait: its locality pass, which moves each node to just before
    its first user (after the wait), is off for graphs with transfers in flight."""
    torch._dynamo.reset()
    with torch.no_grad():
        _, codes = run_and_get_code(torch.compile(sharded, backend=MoECompileBackend(spec),
                                                  fullgraph=True), x_TH)
    if not x_TH.shape[0]:
        return  # an idle rank's graph (it ran the collectives) has no shared-expert GEMM
    code = codes[0][codes[0].index("def call("):]
    first_issue = min(code.index(f"_c10d_functional.{name}.default(") for name in ISSUES
                      if f"_c10d_functional.{name}.default(" in code)
    first_wait = code.index("wait_tensor.default(")
    assert "extern_kernels.mm(" in code[first_issue:first_wait], code


def _run_cases(rank, world_size, a2a):
    _check_opcheck(rank, world_size, a2a)
    _check_chunked_matches_whole(rank, world_size, a2a)
    _check_symbolic_token_count(rank, world_size, a2a)
    _check_overlap_order(rank, world_size, a2a)
    if "inductor" in INNERS[world_size]:
        _check_inductor_keeps_the_order(rank, world_size, a2a)
    _check_explain(rank, world_size, a2a)
    _check_shared_experts_under_the_transfer(rank, world_size, a2a)


@pytest.mark.parametrize("world_size", sorted(TOKENS_PER_RANK))
@pytest.mark.parametrize("a2a", ["all_to_all", "allgather"])
def test_chunked_layer_matches_whole_and_overlaps(a2a, world_size):
    run_on_ranks(world_size, _run_cases, a2a)


@pytest.mark.parametrize("a2a", ["all_to_all", "allgather"])
@pytest.mark.parametrize("tokens, chunk, match", [
    (9, 1, "max_tokens_per_rank"),   # 9 tokens do not fit 2 windows of 4
    (5, 2, "chunk must be in"),
    (5, -1, "chunk must be in"),
])
def test_chunked_ops_name_what_is_wrong(a2a, tokens, chunk, match):
    namespace = {"all_to_all": torch.ops.moe_all_to_all, "allgather": torch.ops.moe_allgather}[a2a]
    ids_TK = torch.zeros(tokens, K, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        namespace.dispatch_tokens_start(torch.randn(tokens, H), torch.ones(tokens, K), ids_TK, 4,
                                        2, "group", 4, chunk, 2)
    with pytest.raises(ValueError, match=match.replace("max_tokens_per_rank",
                                                       "num_chunks \\* max_tokens_per_rank")):
        namespace.combine_tokens_start(torch.randn(8, H), ids_TK, 4, 2, "group", 4, chunk, 2)


def test_independent_work_moves_but_writes_stay_behind_earlier_reads():
    """Work after a layer's first wait that needs none of its transfer moves before the wait;
    a write into a tensor (``buf[0] = 1``, recorded as ``operator.setitem``) stays after a
    read of that tensor that came first, whatever it depends on."""
    graph = fx.Graph()
    x, buf = graph.placeholder("x"), graph.placeholder("buf")
    waited = graph.call_function(torch.neg, (x,))      # stands for the transfer's wait
    read = graph.call_function(torch.add, (waited, buf))
    shared = graph.call_function(torch.relu, (x,))
    write = graph.call_function(operator.setitem, (buf, 0, 1.0))
    graph.output((read, shared, write))
    overlap.hoist_independent_work(waited, {waited})
    order = list(graph.nodes)
    assert order.index(shared) < order.index(waited) < order.index(read) < order.index(write)


def test_independent_work_splits_between_dispatch_and_combine():
    """With the last combine's wait given, the independent work splits at the linear layer
    where half its weights are read: a gated MLP's gate-up projection (2/3 of them) stays
    under the dispatch, its activation and down projection move under the combine."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    w13, w2 = graph.placeholder("w13"), graph.placeholder("w2")
    w13.meta["example_value"], w2.meta["example_value"] = torch.empty(8, 4), torch.empty(4, 4)
    waited = graph.call_function(torch.neg, (x,))     # the dispatch's wait
    combined = graph.call_function(torch.abs, (waited,))
    last_wait = graph.call_function(torch.neg, (combined,))   # the combine's wait
    gate_up = graph.call_function(torch._C._nn.linear, (x, w13))
    activated = graph.call_function(torch.relu, (gate_up,))
    down = graph.call_function(torch._C._nn.linear, (activated, w2))
    out = graph.call_function(torch.add, (last_wait, down))
    graph.output(out)
    overlap.hoist_independent_work(waited, {waited, combined, last_wait}, last_wait)
    assert list(graph.nodes) == [x, w13, w2, gate_up, waited, combined, activated, down,
                                 last_wait, out, graph.output_node()]
