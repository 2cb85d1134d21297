"""A CPU stand-in for ``deep_ep`` (the measured commit's ``Buffer`` API), written from
its documented behaviour, so that the ``deepep`` backend's bookkeeping runs on gloo.

It keeps what the backend relies on and nothing of how DeepEP gets there: the same
calls, argument checks and result layouts; exchanges are ``all_gather_object`` over
the group. What it cannot tell is whether DeepEP's kernels behave as documented:
tests/test_deepep_gpu.py runs the real one.

- Normal mode (intranode): ``dispatch(num_worst_tokens=N)`` returns ``[N, ...]``
  with the received tokens first, in source-rank order, local expert ids (-1 for
  another rank's expert) and their weights (0 there); padding tokens have ids -1
  and garbage elsewhere. ``x`` is a bf16 ``[T, H]`` tensor or DeepEP's fp8 pair
  ``(x [T, H] float8_e4m3fn, scales [T, S] fp32)`` with any S (its kernels copy
  ``scales.size(1)`` floats per token beside the row), and ``recv_x`` has the same
  form. ``combine`` sums each token's rows (and ``topk_weights``)
  over the ranks it went to, in fp32, rounded to bf16 once. A cached-handle
  ``dispatch`` sends the same tokens to the same places.
- Low-latency mode: each (token, slot) is one message to the expert's rank; rank
  ``p``'s messages for expert ``e`` land in one block ``[begin, begin + count)``, the
  blocks in an arbitrary (here random) arrival order and the messages of a block in
  an arbitrary (random) order; ``layout_range`` packs count (low 32 bits) and begin
  (high), at most M messages from one rank to one expert (DeepEP stages them in M slots);
  positions past the count hold garbage. ``low_latency_combine`` sends each
  block back by ``src_info`` and ``layout_range`` (a row per (expert, token): a token that
  chose one expert in two slots sends two rows, which must be equal, to one place) and
  sums ``weight * row`` over each token's slots, reading rows of its blocks only.
  ``use_fp8=True`` casts each token to e4m3 before it leaves, one scale per 128
  columns, as DeepEP's kernel does (`ll_fp8_cast`), and returns ``(x [E_l, Q, H] fp8,
  scales [E_l, Q, H / 128])``, the scales column-major (a transposed ``[E_l, H / 128,
  Q]``); combine is bf16 only.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import sys

import torch
import torch.distributed as dist

topk_idx_t = torch.int64
GARBAGE = 1e4
FP8 = torch.float8_e4m3fn
# DeepEP's low-latency fp8 cast (internode_ll.cu, calculate_fp8_scales without
# round_scale): columns per scale, the floor of a group's amax, e4m3's largest value.
LL_FP8_GROUP = 128
LL_FP8_MARGIN = 1e-4
FP8_MAX = 448.0


class Config:
    def __init__(self, num_sms=20, *chunk_sizes):
        self.num_sms = num_sms

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        return 1 << 20

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        return 0 if num_ranks <= 8 else 1 << 20


def _exchange(per_rank: list, group) -> list:
    """``per_rank[q]`` goes to rank ``q``; returns what each rank sent here, by source."""
    gathered = [None] * group.size()
    dist.all_gather_object(gathered, per_rank, group=group)
    return [sent[group.rank()] for sent in gathered]


def _garbage(shape, dtype):
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, dtype=dtype)
    return (torch.randn(shape) * GARBAGE).to(dtype)


def ll_fp8_cast(x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's low-latency cast of bf16 tokens: per 128 columns, amax (at least
    1e-4), ``fp8(x * (448 / amax))`` saturated, scale ``amax * fp32(1 / 448)``."""
    num_tokens, hidden = x_TH.shape
    x_TGC = x_TH.float().view(num_tokens, hidden // LL_FP8_GROUP, LL_FP8_GROUP)
    amax_TG = x_TGC.abs().amax(2).clamp(min=LL_FP8_MARGIN)
    scale_TG = torch.tensor(FP8_MAX, dtype=torch.float32) / amax_TG
    scale_inv_TG = amax_TG * torch.tensor(1 / FP8_MAX, dtype=torch.float32)
    q_TGC = (x_TGC * scale_TG.unsqueeze(2)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q_TGC.view(num_tokens, hidden), scale_inv_TG


def _parts(x) -> tuple[list[torch.Tensor], bool]:
    """``dispatch``'s ``x`` as the tensors that travel (fp8 values as bytes: CPU
    indexing takes no float8), and whether it was the fp8 pair."""
    if isinstance(x, tuple):
        x_TH, scales_TS = x
        assert x_TH.dtype == FP8 and x_TH.dim() == 2 and x_TH.is_contiguous()
        assert scales_TS.dtype == torch.float32 and scales_TS.dim() == 2
        assert scales_TS.shape[0] == x_TH.shape[0] and x_TH.shape[0] >= 1
        return [x_TH.view(torch.uint8), scales_TS], True
    assert x.dtype == torch.bfloat16 and x.is_contiguous() and x.shape[0] >= 1
    return [x], False


def _received(got: list, num_worst: int, is_fp8: bool):
    """Each part's received rows (``got``: per source, a list of parts) first in a
    ``[num_worst, ...]`` buffer of garbage, in ``dispatch``'s form of ``x``."""
    out = []
    for part in zip(*got):
        rows = torch.cat(part)
        buffer = _garbage((num_worst, *rows.shape[1:]), rows.dtype)
        buffer[:rows.shape[0]] = rows
        out.append(buffer)
    return (out[0].view(FP8), out[1]) if is_fp8 else out[0]


class Buffer:
    num_sms = 20

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                 use_fabric=False, explicitly_destroy=False, enable_shrink=False, comm=None):
        assert num_qps_per_rank > 0
        self.group, self.rank, self.group_size = group, group.rank(), group.size()
        self.low_latency_mode = low_latency_mode
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.destroyed = False
        self.calls = collections.Counter()
        self.arrival = random.Random(1234 + self.rank)

    def destroy(self):
        assert not self.destroyed
        self.destroyed = True

    @staticmethod
    def is_sm90_compiled():
        return True

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                       num_experts):
        return 1 << 20

    @staticmethod
    def get_dispatch_config(num_ranks):
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks):
        return Config(Buffer.num_sms)

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        assert topk_idx.dtype == topk_idx_t and topk_idx.is_contiguous()
        num_local = num_experts // self.group_size
        rank_TK = torch.where(topk_idx < 0, -1, topk_idx // num_local)
        in_rank_TP = torch.stack([(rank_TK == p).any(1) for p in range(self.group_size)], 1)
        per_expert = torch.stack([(topk_idx == e).sum() for e in range(num_experts)]).int()
        return in_rank_TP.sum(0).int(), None, per_expert, in_rank_TP.contiguous(), None

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None,
                 previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        assert not self.low_latency_mode and not self.destroyed
        parts, is_fp8 = _parts(x)
        if handle is not None:
            assert topk_idx is None and topk_weights is None
            _, _, in_rank_TP, num_worst = handle
            got = _exchange([[p[in_rank_TP[:, q]] for p in parts]
                             for q in range(self.group_size)], self.group)
            self.calls["cached_dispatch"] += 1
            return _received(got, num_worst, is_fp8), None, None, None, None, None
        assert num_worst_tokens > 0 and topk_idx.dtype == topk_idx_t
        assert topk_weights.dtype == torch.float32 and topk_weights.is_contiguous()
        num_local = num_tokens_per_expert.shape[0] // self.group_size
        sends = []
        for q in range(self.group_size):
            sent = is_token_in_rank[:, q]
            ids = topk_idx[sent]
            local = torch.where((ids >= q * num_local) & (ids < (q + 1) * num_local),
                                ids - q * num_local, -1)
            weights = torch.where(local >= 0, topk_weights[sent], 0.0)
            sends.append(([p[sent] for p in parts], local, weights,
                          torch.nonzero(sent)[:, 0].int()))
        got = _exchange(sends, self.group)
        counts = [g[1].shape[0] for g in got]
        num_recv, top_k = sum(counts), topk_idx.shape[1]
        assert num_recv <= num_worst_tokens
        recv_x = _received([g[0] for g in got], num_worst_tokens, is_fp8)
        recv_ids = torch.full((num_worst_tokens, top_k), -1, dtype=topk_idx_t)
        recv_weights = _garbage((num_worst_tokens, top_k), torch.float32)
        src_idx = torch.full((num_worst_tokens,), -1, dtype=torch.int32)
        for out, part in ((recv_ids, 1), (recv_weights, 2), (src_idx, 3)):
            out[:num_recv] = torch.cat([g[part] for g in got])
        self.calls["fp8_dispatch" if is_fp8 else "dispatch"] += 1
        handle = (counts, src_idx, is_token_in_rank.clone(), num_worst_tokens)
        return recv_x, recv_ids, recv_weights, [], handle, None

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        assert not self.destroyed and x.dtype == torch.bfloat16 and x.is_contiguous()
        counts, src_idx, in_rank_TP, num_worst = handle
        assert x.shape[0] == num_worst
        if topk_weights is not None:
            assert topk_weights.shape[0] == num_worst and topk_weights.is_contiguous()
            assert topk_weights.dtype == torch.float32
        sends, start = [], 0
        for count in counts:
            rows = slice(start, start + count)
            sends.append((x[rows], src_idx[rows],
                          None if topk_weights is None else topk_weights[rows]))
            start += count
        num_tokens = in_rank_TP.shape[0]
        out_TH = torch.zeros((num_tokens, x.shape[1]))
        out_TK = None if topk_weights is None else torch.zeros((num_tokens,
                                                                 topk_weights.shape[1]))
        for rows_XH, src_X, weights_XK in _exchange(sends, self.group):
            out_TH.index_add_(0, src_X.long(), rows_XH.float())
            if weights_XK is not None:
                out_TK.index_add_(0, src_X.long(), weights_XK)
        self.calls["combine"] += 1
        return out_TH.to(torch.bfloat16), out_TK, None

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8=True, round_scale=False,
                             use_ue8m0=False, async_finish=False, return_recv_hook=False):
        assert self.low_latency_mode and not self.destroyed
        assert not round_scale and not use_ue8m0
        assert x.dtype == torch.bfloat16 and x.is_contiguous() and topk_idx.dtype == topk_idx_t
        max_tokens, hidden = num_max_dispatch_tokens_per_rank, x.shape[1]
        assert 1 <= x.shape[0] <= max_tokens and hidden % 128 == 0
        assert (self.group_size * max_tokens) % 4 == 0
        # What each token's message carries: its row, or its fp8 bytes and scales.
        parts = [x]
        if use_fp8:
            assert hidden % 512 == 0
            q_TH, scale_TS = ll_fp8_cast(x)
            parts = [q_TH.view(torch.uint8), scale_TS]
        num_local = num_experts // self.group_size
        sends = [[] for _ in range(self.group_size)]
        for t, ids in enumerate(topk_idx.tolist()):
            for expert in ids:
                if expert >= 0:
                    sends[expert // num_local].append((expert % num_local, t,
                                                       [p[t] for p in parts]))
        got = _exchange(sends, self.group)
        num_positions = self.group_size * max_tokens
        recv_parts = [_garbage((num_local, num_positions, *p.shape[1:]), p.dtype) for p in parts]
        src_info_EQ = torch.randint(-5, 10 ** 6, (num_local, num_positions), dtype=torch.int32)
        layout_range_EP = torch.zeros((num_local, self.group_size), dtype=torch.int64)
        count_E = torch.zeros(num_local, dtype=torch.int32)
        for e in range(num_local):
            arrival = list(range(self.group_size))
            self.arrival.shuffle(arrival)
            begin = 0
            for p in arrival:
                block = [m for m in got[p] if m[0] == e]
                # DeepEP stages one rank's messages to one expert in M slots.
                assert len(block) <= max_tokens, (p, e, len(block))
                self.arrival.shuffle(block)
                for i, (_, t, rows) in enumerate(block):
                    src_info_EQ[e, begin + i] = t
                    for received, row in zip(recv_parts, rows):
                        received[e, begin + i] = row
                layout_range_EP[e, p] = (begin << 32) | len(block)
                begin += len(block)
            count_E[e] = begin
        self.calls["fp8_low_latency_dispatch" if use_fp8 else "low_latency_dispatch"] += 1
        handle = (src_info_EQ, layout_range_EP, max_tokens, hidden, num_experts)
        if not use_fp8:
            return recv_parts[0], count_E, handle, None, None
        # DeepEP allocates the scales [E_l, H / 128, Q] and hands them back transposed.
        recv_q_EQH, recv_scale_EQS = recv_parts
        recv_scale_EQS = recv_scale_EQS.transpose(1, 2).contiguous().transpose(1, 2)
        return (recv_q_EQH.view(FP8), recv_scale_EQS), count_E, handle, None, None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False,
                            zero_copy=False, async_finish=False, return_recv_hook=False, out=None,
                            combine_wait_recv_cost_stats=None):
        assert self.low_latency_mode and not self.destroyed
        src_info_EQ, layout_range_EP, max_tokens, hidden, num_experts = handle
        num_local = num_experts // self.group_size
        assert x.shape == (num_local, self.group_size * max_tokens, hidden)
        assert x.dtype == torch.bfloat16 and x.is_contiguous()
        assert src_info_EQ.dtype == torch.int32 and src_info_EQ.is_contiguous()
        assert layout_range_EP.dtype == torch.int64 and layout_range_EP.is_contiguous()
        assert layout_range_EP.shape == (num_local, self.group_size)
        assert topk_idx.dtype == topk_idx_t and topk_weights.dtype == torch.float32
        assert topk_idx.shape == topk_weights.shape and 1 <= topk_idx.shape[0] <= max_tokens
        sends = [{} for _ in range(self.group_size)]
        for e in range(num_local):
            for p, packed in enumerate(layout_range_EP[e].tolist()):
                begin, count = packed >> 32, packed & 0xFFFFFFFF
                for j in range(begin, begin + count):
                    key = (self.rank * num_local + e, int(src_info_EQ[e, j]))
                    # A token that chose an expert in two slots came twice: both rows go
                    # back to one place, the last write winning (they must be equal).
                    assert key not in sends[p] or torch.equal(sends[p][key], x[e, j]), key
                    sends[p][key] = x[e, j]
        received = {}
        for sent in _exchange(sends, self.group):
            received.update(sent)
        out_TH = torch.zeros((topk_idx.shape[0], hidden))
        for t, (ids, weights) in enumerate(zip(topk_idx.tolist(), topk_weights.tolist())):
            for expert, weight in zip(ids, weights):
                if expert >= 0:
                    out_TH[t] += weight * received[(expert, t)].float()
        self.calls["low_latency_combine"] += 1
        return out_TH.to(torch.bfloat16), None, None


def install():
    """In this process: ``deep_ep`` is this emulator for the ``deepep`` a2a backend, which
    lets CPU tensors through and runs here (its `supports` says yes). Returns the backend's
    package."""
    sys.modules["deep_ep"] = sys.modules[__name__]
    from torch_moe_ops.backends import deepep
    from torch_moe_ops.backends.deepep import buffer
    from torch_moe_ops.backends.registry import REGISTRY

    buffer.DEVICE_TYPE = "cpu"
    REGISTRY.a2a["deepep"] = dataclasses.replace(REGISTRY.a2a["deepep"],
                                                 supports=lambda *_: None)
    return deepep
