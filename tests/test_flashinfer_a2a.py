"""The ``flashinfer`` a2a backend without GPUs or flashinfer: the workspace arithmetic and
its refusal, the shapes the kernels take, `supports` reasons, the formats it declares and
the plan's choice between tokens and rows, the tokens format's contract,
and the bookkeeping that turns receive positions into rows.

Multi-rank behaviour (on a CPU stand-in of flashinfer) is tests/test_flashinfer_a2a_emulated.py,
the real kernels tests/test_flashinfer_a2a_gpu.py.

Legend: P ranks, M max_tokens_per_rank, N = P * M receive positions, H hidden size,
K experts per token, E_l experts per rank.
"""

from __future__ import annotations

import dataclasses
import operator

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_moe_ops as tmo
from torch_moe_ops.backends.common.kernels.rows import sum_slots
from torch_moe_ops.backends.common.transport import token_positions, token_routing
from torch_moe_ops.backends.flashinfer import a2a
from torch_moe_ops.backends.flashinfer import a2a_sizes as sizes
from torch_moe_ops.backends.flashinfer.a2a import bookkeeping
from torch_moe_ops.backends.registry import MASKED, REGISTRY, ROWS, TOKENS, Problem
from torch_moe_ops.config import BackendSpec, QuantSpec
from torch_moe_ops.lowering import rewrite
from torch_moe_ops.lowering.plan import plan_layer

BF16 = torch.bfloat16
GIB = 1 << 30
SPEC = BackendSpec(a2a="flashinfer")


def test_bytes_per_token_and_payload_regions():
    # DeepSeek-V3 widths: activations, ids with the token index, fp32 weights.
    assert sizes.dispatch_bytes_per_token(7168, 8, BF16) == 7168 * 2 + 4 * 9 + 4 * 8
    assert sizes.combine_bytes_per_token(7168, BF16) == 7168 * 2
    assert sizes.combine_bytes_per_token(7168, torch.float32) == 7168 * 4
    assert sizes.payload_bytes(2, 128, 7168, 8, BF16) == 256 * 14404 + 256 * 14336
    # Each region is padded to 128 bytes.
    assert sizes.payload_bytes(2, 1, 6, 1, BF16) == 128 + 128


def test_a_workspace_too_large_is_refused_saying_how_to_lower_it():
    # A large capacity times a large group: about 241 GB per rank.
    needed = sizes.payload_bytes(64, 131072, 7168, 8, BF16)
    assert needed > 200e9
    reason = sizes.why_not_fits(needed, 80 * GIB, 64, 131072, 7168, 8, BF16)
    fits = sizes.largest_max_tokens(80 * GIB, 64, 7168, 8, BF16)
    assert sizes.payload_bytes(64, fits, 7168, 8, BF16) <= 80 * GIB
    assert sizes.payload_bytes(64, fits + 1, 7168, 8, BF16) > 80 * GIB
    assert f"{needed / GIB:.2f} GiB per rank (64 ranks x max_tokens_per_rank 131072" in reason
    assert "80.00 GiB free" in reason
    assert f"lower MoEConfig.max_tokens_per_rank (at most about {fits} fits)" in reason
    assert sizes.why_not_fits(needed, needed, 64, 131072, 7168, 8, BF16) is None


@pytest.mark.parametrize("shape, reason", [
    ((65, 8, BF16, None, None), "at most 64 ranks, got ep_size=65"),
    ((2, 3, BF16, None, None), ("compiled for top_k in (1, 2, 4, 6, 8, 10, 12, 14, 16, 18, "
                                "22), got 3")),
    ((2, 8, torch.float64, None, None), "got torch.float64"),
    ((4, 2, BF16, 2, None), "at least one expert per rank, got 2 experts on 4 ranks"),
    ((2, 2, BF16, None, 7), ("multiple of 4 (the payloads after the activations hold 4-byte "
                             "values), got H=7 in torch.bfloat16")),
], ids=["ranks", "top_k", "dtype", "experts", "hidden"])
def test_shapes_the_kernels_do_not_take(shape, reason):
    assert reason in sizes.why_not_shape(*shape)
    assert reason in a2a.supports(SPEC, Problem(shape[2], ep_size=shape[0], top_k=shape[1],
                                                num_experts=shape[3], hidden_size=shape[4]),
                                  torch.device("cuda"))


def test_shapes_the_kernels_take():
    assert sizes.why_not_shape(2, 8, BF16, 256, 7168) is None
    assert sizes.why_not_shape(None, None, None) is None
    assert sizes.why_not_shape(2, 1, torch.float16, hidden_size=2) is None


def test_supports_explains_every_no_here():
    one_device = a2a.supports(SPEC, Problem(BF16, ep_size=1), torch.device("cpu"))
    assert one_device == "needs expert parallelism (ep_size > 1); a2a 'none' runs one device"
    assert a2a.supports(SPEC, Problem(BF16, ep_size=2), torch.device("cpu")) == (
        "needs a CUDA device, got cpu")
    if not torch.cuda.is_available():
        assert "this torch sees none" in a2a.supports(SPEC, Problem(BF16, ep_size=2),
                                                      torch.device("cuda"))
    row = next(r for r in tmo.available_backends("cpu")
               if (r.kind, r.name) == ("a2a", "flashinfer"))
    assert not row.available and row.reason == "needs a CUDA device, got cpu"


def test_the_formats_follow_from_the_ops_each_namespace_defines():
    flashinfer = REGISTRY.a2a["flashinfer"]
    assert flashinfer.formats == (TOKENS, ROWS)
    # Its receive buffers are the workspace's: its tokens ops serve inference, and those of
    # its training namespace, which copy the buffers out, train.
    assert flashinfer.trains(TOKENS) and flashinfer.trains(ROWS)
    assert flashinfer.namespace_of(TOKENS, False) == a2a.NAMESPACE
    assert flashinfer.namespace_of(TOKENS, True) == a2a.TRAINING_NAMESPACE
    assert flashinfer.namespace_of(ROWS, True) == a2a.NAMESPACE
    assert not any(hasattr(torch.ops.moe_flashinfer_a2a, op)
                   for op in ("dispatch_tokens_backward", "combine_tokens_backward"))
    for name in ("all_to_all", "allgather"):
        assert REGISTRY.a2a[name].formats == (TOKENS, ROWS)
        assert REGISTRY.a2a[name].trains(TOKENS)
    # DeepEP's tokens format keeps its handle for the next combine only, its masked blocks
    # are its low-latency receive buffer: inference.
    deepep = REGISTRY.a2a["deepep"]
    assert deepep.formats == (MASKED, TOKENS, ROWS)
    assert not deepep.trains(MASKED) and not deepep.trains(TOKENS) and deepep.trains(ROWS)
    reads_masked = {"reference", "triton", "grouped_mm", "deepgemm"}
    assert all(b.formats == ((MASKED,) if name in reads_masked else ()) + (TOKENS, ROWS)
               for name, b in REGISTRY.experts.items())
    with pytest.raises(ValueError,
                       match="namespace 'moe_reference' must define the ops of a format"):
        REGISTRY.register_a2a(dataclasses.replace(flashinfer, name="nothing",
                                                   namespace="moe_reference"))


def test_an_unavailable_choice_fails_naming_why_and_what_runs():
    with pytest.raises(ValueError, match="a2a backend 'flashinfer' is not available: needs a "
                                         "CUDA device, got cpu; available a2a backends on cpu"):
        REGISTRY.choose_a2a(SPEC, Problem(BF16, ep_size=2), torch.device("cpu"))


@pytest.fixture
def runs_here(monkeypatch):
    """The flashinfer a2a and the triton experts run on this CPU, as far as the registry knows."""
    for table, name in ((REGISTRY.a2a, "flashinfer"), (REGISTRY.experts, "triton")):
        monkeypatch.setitem(table, name, dataclasses.replace(table[name],
                                                             supports=lambda *_: None))


@pytest.mark.parametrize("experts, problem, namespace", [
    ("triton", Problem(BF16, ep_size=2, training=False), a2a.NAMESPACE),
    ("triton", Problem(BF16, ep_size=2, training=True), a2a.TRAINING_NAMESPACE),
    # It sends no fp8 rows: a quantized layer's tokens cross in bf16, in the tokens format.
    ("triton", Problem(BF16, ep_size=2, quant=QuantSpec("fp8_channel")), a2a.NAMESPACE),
    ("cpu", Problem(BF16, ep_size=2), a2a.NAMESPACE),
], ids=["inference", "training", "quantized", "any_experts"])
def test_the_plan_takes_tokens_and_the_trainable_ops_for_layers_that_train(
        runs_here, experts, problem, namespace):
    plan = plan_layer(BackendSpec(experts=experts, a2a="flashinfer"), problem,
                      torch.device("cpu"))
    assert plan.format.name == "tokens" and plan.experts.name == experts
    assert all(plan.namespace_for(op) == namespace
               for op in ("dispatch_tokens", "combine_tokens", "dispatch_tokens_backward"))
    # The rows ops (a quantized layer of another experts backend) stay where they are.
    assert plan.namespace_for("dispatch") == plan.namespace_for("combine_backward") == (
        a2a.NAMESPACE)
    copies = "trains through moe_flashinfer_a2a_trainable's ops, which copy the receive buffers"
    assert (copies in plan.format_reason) == bool(problem.training), plan.format_reason


def _layer_graph(extra_reader: bool) -> tuple[fx.Graph, fx.Node, fx.Node, fx.Node]:
    """A layer's ``moe::dispatch -> moe::experts_rows -> moe::combine`` as the module emits
    it; ``extra_reader``: something else reads ``x_rows`` too."""
    graph = fx.Graph()
    hidden, weights, ids, w13, w2 = (graph.placeholder(n) for n in ("h", "w", "i", "a", "b"))
    ep_args = (2, "group", 4)
    dispatch = graph.call_function(torch.ops.moe.dispatch.default,
                                   (hidden, weights, ids, 4, *ep_args, 8))
    out = [graph.call_function(operator.getitem, (dispatch, i)) for i in range(6)]
    experts = graph.call_function(torch.ops.moe.experts_rows.default,
                                  (out[0], out[1], out[4], w13, w2, None, None, "silu", 1.7, 7.0))
    combine = graph.call_function(torch.ops.moe.combine.default,
                                  (experts, out[2], out[3], out[5], *ep_args))
    result = [combine]
    if extra_reader:
        result.append(graph.call_function(torch.ops.aten.sum.default, (out[0],)))
    graph.output(tuple(result))
    return graph, dispatch, experts, combine


def test_a_layer_chain_is_found_only_where_nothing_else_reads_its_rows():
    _, dispatch, experts, combine = _layer_graph(extra_reader=False)
    assert rewrite._rows_chain(dispatch) == (experts, combine)
    _, dispatch, _, _ = _layer_graph(extra_reader=True)
    assert rewrite._rows_chain(dispatch) is None


def test_the_tokens_contract_gives_receive_buffers_of_static_size():
    mode = FakeTensorMode()
    with mode:
        hidden_TH = torch.empty(3, 16, dtype=BF16)
        weights_TK = torch.empty(3, 2)
        ids_TK = torch.empty(3, 2, dtype=torch.int32)
        x_NH, weights_NK, local_NK = torch.ops.moe_flashinfer_a2a.dispatch_tokens(
            hidden_TH, weights_TK, ids_TK, 8, 2, "group", 4)
        y_TH = torch.ops.moe_flashinfer_a2a.combine_tokens(x_NH, ids_TK, 8, 2, "group", 4)
    assert (x_NH.shape, x_NH.dtype, x_NH.stride()) == ((8, 16), BF16, (16, 1))
    assert (weights_NK.shape, weights_NK.dtype) == ((8, 2), torch.float32)
    assert (local_NK.shape, local_NK.dtype) == ((8, 2), torch.int32)
    assert y_TH.shape == (3, 16) and y_TH.dtype == BF16


@pytest.mark.parametrize("args, message", [
    (((5, 16), 8, 2, 4), (r"hidden.shape\[0\] \(tokens on this rank\) must be <= "
                          r"max_tokens_per_rank \(4\), got 5")),
    (((3, 16), 8, 0, 4), "ep_size must be >= 1, got 0"),
    (((5, 16), 8, 1, 4), (r"hidden.shape\[0\] \(tokens on this rank\) must be <= "
                          r"max_tokens_per_rank \(4\), got 5")),
    (((3, 16), 7, 2, 4), r"num_experts must be divisible by ep_size \(2\), got 7"),
], ids=["over_capacity", "no_rank", "one_rank_over_capacity", "experts"])
def test_bad_dispatch_fails_before_any_kernel(args, message):
    (tokens, hidden), num_experts, ep_size, max_tokens = args
    with FakeTensorMode(), pytest.raises(ValueError, match=message):
        torch.ops.moe_flashinfer_a2a.dispatch_tokens(
            torch.empty(tokens, hidden, dtype=BF16), torch.empty(tokens, 2),
            torch.empty(tokens, 2, dtype=torch.int32), num_experts, ep_size, "group", max_tokens)


def test_combine_tokens_takes_one_row_per_receive_position():
    with FakeTensorMode(), pytest.raises(ValueError, match=r"y_tokens.shape\[0\] must equal "
                                                           r"ep_size \* max_tokens_per_rank"):
        torch.ops.moe_flashinfer_a2a.combine_tokens(torch.empty(7, 16, dtype=BF16),
                                                    torch.empty(3, 2, dtype=torch.int32), 8,
                                                    2, "group", 4)


def test_the_trainable_ops_take_the_contract_and_say_where_they_run():
    """The gradient ops' fakes give the contract's sizes; a CPU tensor is refused naming
    the argument and the device (before any kernel)."""
    ops = torch.ops.moe_flashinfer_a2a_trainable
    with FakeTensorMode():
        grad_x_NH = ops.combine_tokens_backward(torch.empty(3, 16, dtype=BF16),
                                                torch.empty(3, 2, dtype=torch.int32), 8, 2,
                                                "group", 4)
        grad_TH, grad_weights_TK = ops.dispatch_tokens_backward(
            grad_x_NH, torch.empty(8, 2), torch.empty(3, 2, dtype=torch.int32), 8, 2, "group",
            4)
    assert (grad_x_NH.shape, grad_x_NH.dtype) == ((8, 16), BF16)
    assert (grad_TH.shape, grad_weights_TK.shape, grad_weights_TK.dtype) == (
        (3, 16), (3, 2), torch.float32)
    with pytest.raises(ValueError, match="grad_out must be on a CUDA device for a2a backend "
                                         "'flashinfer', got cpu"):
        ops.combine_tokens_backward(torch.zeros(3, 16, dtype=BF16),
                                    torch.zeros(3, 2, dtype=torch.int32), 8, 2, "group", 4)


def test_receive_positions_become_keys_and_local_ids():
    # M = 2: positions 0, 1 came from rank 0, positions 2, 3 from rank 1; -1 is padding.
    token_N = torch.tensor([1, -1, 0, 1], dtype=torch.int32)
    key_N = bookkeeping._keys(token_N, 2)
    assert key_N.tolist() == [1, -1, 2, 3]
    assert bookkeeping._positions(key_N).tolist() == [-1, 0, 2, 3]
    ids_NK = torch.tensor([[2, 0], [3, -1], [1, 2]], dtype=torch.int32)
    assert bookkeeping.ranks_of(ids_NK, num_local=2).tolist() == [[1, 0], [1, -1], [0, 1]]


@pytest.mark.triton
def test_received_ids_become_local_with_padding_marked():
    from torch_moe_ops.backends.flashinfer import received_ids

    # Rank 1 of 2 with 4 experts, M = 2: 2 tokens came from rank 0, 1 from rank 1; the
    # fourth position is padding with garbage in it, the -1 a skipped slot.
    # On the GPU where there is one (conftest sets the interpreter only where there is not).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids_NK = torch.tensor([[2, 0], [3, -1], [1, 2], [3, 7]], dtype=torch.int32, device=device)
    counts_P = torch.tensor([2, 1], dtype=torch.int32, device=device)
    local_NK = received_ids.local_ids(ids_NK, counts_P, max_tokens_per_rank=2, first_local=2,
                                      num_local=2)
    assert local_NK.tolist() == [[0, -1], [1, -1], [-1, 0], [-1, -1]]
    assert local_NK.dtype == torch.int32


def test_compiled_rows_bookkeeping_matches_eager():
    """What the GPU runs compiled (`bookkeeping._compiled_on_gpu`), compiled here on the
    CPU: the same outputs as eagerly, bit for bit but the weights' gradient (an fp32 sum
    over H)."""
    P, M, K, H, E_l = 2, 6, 2, 16, 3
    gen = torch.Generator().manual_seed(0)
    # Rank 0 sent 4 tokens, rank 1 sent 2, in the order they arrived; -1 is padding.
    token_N1 = torch.full((P * M, 1), -1, dtype=torch.int32)
    token_N1[:4, 0] = torch.tensor([2, 0, 3, 1])
    token_N1[M:M + 2, 0] = torch.tensor([1, 0])
    local_NK = torch.randint(-1, E_l, (P * M, K), generator=gen, dtype=torch.int32)
    local_NK[token_N1[:, 0] < 0] = -1

    def both(segment, *args):
        eager, compiled = segment(*args), segment.compiled()(*args)
        if isinstance(eager, torch.Tensor):
            eager, compiled = (eager,), (compiled,)
        for e, c in zip(eager, compiled, strict=True):
            assert (e.shape, e.dtype) == (c.shape, c.dtype)
            torch.testing.assert_close(c, e, rtol=1e-5 if e.dtype == torch.float32 else 0,
                                       atol=1e-5 if e.dtype == torch.float32 else 0)
        return eager

    position_G, local_GK = both(bookkeeping.in_key_order, local_NK, token_N1, M)
    x_NH = torch.randn(P * M, H, generator=gen).bfloat16()
    weights_NK = torch.rand(P * M, K, generator=gen)
    _, _, weight_R, src_R, _ = both(bookkeeping.received_rows, x_NH, weights_NK, local_GK,
                                    position_G, E_l, P * M * K, K)
    y_RH = torch.randn(src_R.shape[0], H, generator=gen).bfloat16()
    for weights in (weight_R, None):
        both(bookkeeping.summed_rows, y_RH, src_R, token_N1, weights, M, K)
    both(bookkeeping.rows_of_grad, torch.randn(P * M, H, generator=gen).bfloat16(), y_RH,
         weight_R, src_R, token_N1, M, K)


def _arrivals(ids_PTK, receiver, num_experts, max_tokens, gen):
    """What FlashInfer's dispatch leaves on rank ``receiver`` from the ``[T, K]`` ids of each
    rank: each token at a position of its source's block in a random order (a skipped slot
    routed to rank 0), garbage at padding, and the receive counters. ``(token_N, ids_NK,
    counts_P)``."""
    num_ranks, top_k = len(ids_PTK), ids_PTK[0].shape[1]
    token_N = torch.randint(-9, 99, (num_ranks * max_tokens,), generator=gen,
                            dtype=torch.int32)
    ids_NK = torch.randint(-9, 99, (num_ranks * max_tokens, top_k), generator=gen,
                           dtype=torch.int32)
    counts_P = torch.zeros(num_ranks, dtype=torch.int32)
    for source, ids_TK in enumerate(ids_PTK):
        ranks_TK = torch.where(ids_TK < 0, 0, ids_TK // (num_experts // num_ranks))
        came = (ranks_TK == receiver).any(1).nonzero()[:, 0]
        came = came[torch.randperm(came.numel(), generator=gen)]
        start = source * max_tokens
        token_N[start:start + came.numel()] = came.int()
        ids_NK[start:start + came.numel()] = ids_TK[came]
        counts_P[source] = came.numel()
    return token_N, ids_NK, counts_P


def test_tokens_received_in_any_order_find_the_positions_their_senders_gave_them():
    """`token_positions.received_positions` on what arrived in a random order equals the
    send positions each sender computes from its ids alone (what the all_to_all backend
    sends to): skipped slots (which FlashInfer routes to rank 0 all the same), repeated ids,
    an idle rank; a token that came only for a skipped slot has none."""
    P, M, K, E = 3, 6, 3, 6
    gen = torch.Generator().manual_seed(0)
    ids_PTK = [torch.randint(-1, E, (t, K), generator=gen, dtype=torch.int32)
               for t in (5, 0, 6)]
    ids_PTK[2][1] = torch.tensor([4, 4, -1])
    for receiver in range(P):
        token_N, ids_NK, counts_P = _arrivals(ids_PTK, receiver, E, M, gen)
        token_N = bookkeeping._arrived(token_N.unsqueeze(1), counts_P, M)
        position_N = token_positions.received_positions(
            token_routing.local_ids(ids_NK, receiver, E // P), token_N, M)
        for source, ids_TK in enumerate(ids_PTK):
            send_position_TP, _ = token_positions.send_positions(ids_TK, E, P, M)
            # Block `receiver` of the sender's send buffer is block `source` here.
            sent_T = send_position_TP[:, receiver].long() - receiver * M + source * M
            sent_T[send_position_TP[:, receiver] < 0] = -1
            block = slice(source * M, (source + 1) * M)
            expected = [-1 if t < 0 else int(sent_T[t]) for t in token_N[block].tolist()]
            assert position_N[block].tolist() == expected, (receiver, source)


def test_compiled_tokens_bookkeeping_matches_eager_and_inverts():
    """The trainable tokens format's reordering, compiled as the GPU runs it and eagerly:
    bit for bit alike; token order and back is the identity on the positions a token came
    to for this rank's experts, zeros elsewhere; the outputs are copies."""
    P, M, K, E, H, rank = 2, 5, 2, 4, 8, 1
    gen = torch.Generator().manual_seed(1)
    ids_PTK = [torch.randint(-1, E, (t, K), generator=gen, dtype=torch.int32) for t in (5, 3)]
    token_N, ids_NK, counts_P = _arrivals(ids_PTK, rank, E, M, gen)
    x_NH = torch.randn(P * M, H, generator=gen).bfloat16()
    weights_NK = torch.rand(P * M, K, generator=gen)
    order = (ids_NK, token_N.unsqueeze(1), counts_P, rank, E // P, M)
    eager = bookkeeping.tokens_in_token_order(x_NH, weights_NK, *order)
    compiled = bookkeeping.tokens_in_token_order.compiled()(x_NH, weights_NK, *order)
    for e, c in zip(eager, compiled, strict=True):
        assert torch.equal(e, c) and e.dtype == c.dtype
        assert e.untyped_storage().data_ptr() != x_NH.untyped_storage().data_ptr()
    x_tokens_NH, _, local_NK = eager
    assert local_NK.dtype == torch.int32
    assert torch.equal(bookkeeping.rows_in_token_order(x_NH, *order), x_tokens_NH)
    back_NH = bookkeeping.rows_in_arrival_order(x_tokens_NH, *order)
    assert torch.equal(back_NH, bookkeeping.rows_in_arrival_order.compiled()(x_tokens_NH, *order))
    came_N = ((bookkeeping._arrived(token_N.unsqueeze(1), counts_P, M) >= 0)
              & (token_routing.local_ids(ids_NK, rank, E // P) >= 0).any(1))
    assert torch.equal(back_NH[came_N], x_NH[came_N]) and not back_NH[~came_N].any()
    # In token order: the came tokens first in each block, ids -1 after them.
    filled_PM = (local_NK >= 0).any(1).view(P, M)
    assert torch.equal(filled_PM, filled_PM.sort(1, descending=True).values)
    assert filled_PM.sum() == came_N.sum()
    # The routing weights' gradients summed home over ids padded to M tokens: the sum over
    # the unpadded tokens, compiled alike.
    returned_NK = torch.randn(P * M, K, generator=gen)
    ids_MK = torch.nn.functional.pad(ids_PTK[0], (0, 0, 0, M - ids_PTK[0].shape[0]), value=-1)
    summed_MK = bookkeeping.summed_home(returned_NK, ids_MK, E, P, M)
    assert torch.equal(summed_MK, bookkeeping.summed_home.compiled()(returned_NK, ids_MK, E, P,
                                                                     M))
    send_position_TP, _ = token_positions.send_positions(ids_PTK[0], E, P, M)
    expected_TK = sum_slots(returned_NK, send_position_TP)
    assert torch.equal(summed_MK[:ids_PTK[0].shape[0]], expected_TK)


def test_rows_are_summed_into_the_position_of_their_token():
    # K = 2, keys 0..3; rows hold slots key * K + k.
    rows_RH = torch.tensor([[1.0], [2.0], [4.0], [8.0]])
    src_R = torch.tensor([1, 6, 7, -1], dtype=torch.int32)
    # Position 0 holds key 3, position 1 key 0, position 2 padding, position 3 key 1.
    key_N = torch.tensor([3, 0, -1, 1])
    summed_NH = bookkeeping._sum_received(rows_RH, src_R, key_N, top_k=2)
    assert summed_NH[:, 0].tolist() == [2.0 + 4.0, 1.0, 0.0, 0.0]
