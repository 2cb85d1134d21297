"""Expert-parallel transport and layer step of every a2a backend, on 2 GPUs over NCCL.

    torchrun --nproc-per-node 2 benchmarks/bench_ep.py --out DIR
    torchrun --nproc-per-node 2 benchmarks/bench_ep.py --out DIR --smoke  # CPU, gloo, tiny
    torchrun --nproc-per-node 2 benchmarks/bench_ep.py --out DIR --a2a all_to_all \
        --experts 256 --chunks 2,4                   # the layer whole and in 2 and 4 chunks
    torchrun --nproc-per-node 1 benchmarks/bench_ep.py --out DIR --one-rank  # one GPU
    torchrun --nproc-per-node 2 benchmarks/bench_ep.py --out DIR --a2a deepep \
        --experts 256 --tokens-only --no-layer --deepep-sms 24   # DeepEP on 24 SMs

Legend: P ranks, T tokens per rank (M = max_tokens_per_rank = T here), H hidden
size, I expert intermediate size, K experts per token, E experts, E_l = E / P,
C rows one rank sends each rank (the capacity; worst case M * K),
b bytes per element (2, bf16).

Three phases, each in the same run, every time the slower rank's (max over ranks):

1. transport: ``dispatch`` then ``combine`` (the rows sent back untouched, no
   experts) of each a2a backend, at decode (T=128) and prefill (T=4096),
   H=7168, K=8, E=64 and 256, bf16, uniformly random routing; default (worst-case)
   capacity, and for all_to_all also a smaller one, ``--capacity-factor`` times the
   even share T * K / P (2x the even share is the worst case itself at P=2, K=8).
   Each op is captured in a CUDA graph; the time is the median of back-to-back
   replays timed with CUDA events. A capacity below the worst case makes dispatch
   check the routing with an all-reduce and a host read, which a CUDA graph cannot
   hold: the routing is checked eagerly first, and the captured graph runs without
   that check (its cost is not in the time). ``deepep`` (where DeepEP is built):
   its rows ops in low-latency mode at T=128, normal mode at T=4096, eager only (its ops
   stay whole in a compiled graph), then its tokens format (normal mode at both sizes,
   mode ``tokens``: ``dispatch_tokens`` + ``combine_tokens`` with the receive buffers sent
   back untouched), judged against raw NCCL moving one row per token per peer; DeepEP's
   own tests (tests/test_intranode.py, tests/test_low_latency.py) run at the same sizes in
   the same call (`scripts/ep_gpu_check.sh`), and are its yardstick. At T=128 also its
   masked format (mode ``masked``: ``dispatch_masked`` + ``combine_masked`` of the receive
   blocks untouched, low-latency mode, captured as a pair) against DeepEP's own round trip,
   ``Buffer.low_latency_dispatch`` + ``low_latency_combine`` of the same payloads called
   directly, captured alike (target: within 1.05x of it). ``flashinfer`` (where
   flashinfer-python runs): its rows ops as a captured dispatch + combine pair, eager only
   (they stay whole in a compiled graph); then its tokens transport, ``dispatch_tokens``
   + ``combine_tokens`` with the receive buffers sent back untouched (mode ``tokens``), and
   FlashInfer's own round trip, ``MoeAlltoAll.dispatch`` (with its id sanitizer) +
   ``.combine`` of the same payloads called directly, captured alike: its yardstick (target:
   tokens within 1.1x of it; rows sort and gather on top and are judged against it too).
2. raw NCCL, captured alike: ``dist.all_to_all_single`` of the same padded
   ``[P * C, H]`` buffers, forward and back (the bytes dispatch and combine move),
   the same at the even share (what an exactly sized exchange would move), and
   ``all_gather_into_tensor`` + ``reduce_scatter_tensor`` of ``[M, H]`` (allgather's
   collectives).
3. layer: the forward of a ``tmo.MoE`` with ``ep_size=P`` at DeepSeek-V3 widths
   (H=7168, I=2048, E=256, K=8, softmax routing), compiled with
   ``tmo.backend(a2a=...)`` and ``mode="reduce-overhead"`` (if that fails: Inductor
   without CUDA graphs, captured by hand), against the local experts alone
   (``moe::experts_rows`` on E_l experts and the rows an all_to_all dispatch of
   uniformly random routing delivers, captured) plus the raw transport of the
   backend's collectives. The layer moves whole (``chunks=1``); beside it, at the largest
   token count, each chunk count of ``--chunks`` that the plan takes for the layer
   (``auto``: the plan's own choice) gives a row of the layer whose tokens move in chunks,
   transfers issued and waited around another chunk's experts (`lowering.overlap`),
   against the same sum.

Bytes one rank sends its peers (GB/s = those bytes / time):
    all_to_all  (P-1) * C * (2*H*b + 8)   rows out and back, + int32 expert id and fp32 weight
    allgather   (P-1) * M * (2*H*b + 8*K) all-gather of tokens, ids, weights + reduce-scatter
    deepep      (P-1) * M * 2*H*b         each token to each peer at most once, there and back
                (tokens: + 12*K, its int64 ids and fp32 weights; masked: (P-1)/P * M * K
                rows there and back, one per (token, slot) on another rank)
    flashinfer  (P-1) * M * (2*H*b + 8*K + 4)  the same, with ids, weights and token index
    raw a2a     2 * (P-1) * C * H * b     (even share: C = T * K / P)
    raw ag+rs   2 * (P-1) * M * H * b

Targets: all_to_all dispatch + combine within 1.15x raw NCCL on the same bytes; deepep
within 1.1x of DeepEP's own round trip (tokens) and 1.05x (masked); flashinfer within 1.05x
of MoeAlltoAll; layer step <= 1.1x (local experts + raw transport), <= 1.02x with a shared
expert at T=4096 (``--shared``: the shared expert hidden under the transport); the chunked
layer at T=4096 <= 0.95x of that sum (transfers hidden under expert compute).

``--one-rank`` (one process, one GPU): only the ``flashinfer`` transport cases, at P = 1,
where every token stays on its GPU: what the backend adds to FlashInfer's own round trip
(its own kernels and host work), without the NVLink transfers that P = 2 adds to both.

``--profile``: after each row's timed replays (so its times are the profile's own), a few
more (``--profile-steps``, 5) under ``torch.profiler`` on every rank (CUDA activities; the
smoke run profiles the CPU, its ops standing in for kernels and its threads for streams):
per row a table in ``ep.md`` of the kernels per step by class (`kernel_profile.CLASSES`:
NCCL / DeepEP / FlashInfer transport, Triton kernels by name, GEMMs, sort, reductions,
copy/pack/gather/index, other), with count, us and the streams they ran on, and the time
each class ran concurrently with a transport kernel; the step's busy time against its span
and its timed wall time; where a transport ran, its time, the part of it that ran beside
another kernel (overlap) and the rest (exposed). The rank with the longest span per step is
shown. ``--profile-traces`` adds rank 0's chrome trace per row under ``OUT/traces``. DeepEP's
own round trip (`peer_deepep`) is not profiled.

Every collective is bounded by the process group's timeout (``--timeout-s``), and
a case starts only while the run is within ``--budget-s`` (decided on all ranks
alike); the rest are listed as skipped. Rank 0 writes ``ep.json``, ``ep.md`` and
``summary.txt`` (the short table it prints last) to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import itertools
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
import unittest.mock
import warnings
from collections.abc import Callable

import kernel_profile
import peer_deepep
import torch
import torch.distributed as dist

import torch_moe_ops as tmo
from torch_moe_ops.backends import deepep
from torch_moe_ops.backends.common.transport import collectives
from torch_moe_ops.backends.deepep import modes as deepep_modes
from torch_moe_ops.backends.deepep.modes import LOW_LATENCY_MAX_TOKENS
from torch_moe_ops.backends.flashinfer import a2a as flashinfer_a2a
from torch_moe_ops.backends.flashinfer import a2a_sizes as flashinfer_sizes
from torch_moe_ops.backends.flashinfer import library as flashinfer_library
from torch_moe_ops.backends.registry import REGISTRY, Problem
from torch_moe_ops.config import worst_case_capacity
from torch_moe_ops.lowering.plan import plan_layer
from torch_moe_ops.ops import op_overload

# The a2a backends measured, where they run; one registered later joins with its name here.
A2A_NAMES = ("all_to_all", "allgather", "deepep", "flashinfer")
# Those whose ops stay whole in compiled graphs (DeepEP's and FlashInfer's kernels):
# compiled is eager.
EAGER_ONLY_A2A_NAMES = ("deepep", "flashinfer")
# Those captured and timed as a dispatch + combine pair: DeepEP's low-latency kernels
# alternate between two buffers call by call, and FlashInfer's dispatch must be answered by
# its combine before the next dispatch, so a replayed graph must hold both.
PAIRED_A2A_NAMES = ("deepep", "flashinfer")
# Those whose transport shrinks with a capacity below the worst case.
CAPACITY_A2A_NAMES = ("all_to_all",)
# Those whose tokens format is timed (the format the lowering takes where it can).
TOKENS_A2A_NAMES = ("all_to_all", "allgather", "deepep", "flashinfer")
# Those whose masked format (DeepEP low-latency's blocks) is timed, at decode sizes.
MASKED_A2A_NAMES = ("deepep",)
TARGET_TRANSPORT = 1.15
# The deepep masked transport against DeepEP's own low-latency round trip.
TARGET_DEEPEP_LOW_LATENCY = 1.05
# The flashinfer tokens transport against FlashInfer's own round trip.
TARGET_FLASHINFER = 1.05
# The deepep backend against DeepEP's own round trip (peer_deepep).
TARGET_DEEPEP = 1.1
TARGET_LAYER = 1.1
# The layer with a shared expert at T=4096: the shared expert hidden under the transport.
TARGET_SHARED_HIDDEN = 1.02
# The layer moved in chunks, against the same sum: part of the transport hidden.
TARGET_OVERLAP = 0.95
DTYPE_BYTES = 2


@dataclasses.dataclass(frozen=True)
class Sizes:
    hidden: int
    inter: int
    top_k: int
    experts: tuple[int, ...]
    tokens: tuple[int, ...]
    layer_experts: int
    layer_tokens: tuple[int, ...]
    replays: int


FULL = Sizes(hidden=7168, inter=2048, top_k=8, experts=(64, 256), tokens=(128, 4096),
             layer_experts=256, layer_tokens=(128, 4096), replays=50)
SMOKE = Sizes(hidden=64, inter=32, top_k=2, experts=(8,), tokens=(4, 16), layer_experts=8,
              layer_tokens=(4, 16), replays=5)


class EveryRank:
    """Runs a piece of a benchmark on every rank of the default group, failing on all where
    it fails on one (`run`)."""

    def __init__(self, rank: int, world: int):
        self.rank = rank
        self.world = world
        # Why the group was aborted, None while it lives.
        self.aborted: str | None = None
        self._attempts = 0

    def run(self, what: str, fn: Callable[[], object]) -> object:
        """``fn()``, raising on every rank where it raises on one, without the wait for the
        group's timeout: a peer that raises (torchtitan's compiled layer checks splits that
        only one rank may get wrong) would leave the others inside a collective it never
        joins. The failing rank posts ``what`` in the group's store (out of band: no
        collective can answer a collective) and aborts its communicators; a watcher thread
        on every other rank aborts its own on the post, which ends the collective it waits
        in; a rank whose ``fn`` returned meets the post before it goes on. After a failure
        the group is gone: `aborted` says why, and nothing more runs across ranks."""
        store = dist.distributed_c10d._get_default_store()
        key = f"every_rank/{self._attempts}"
        self._attempts += 1
        finished = threading.Event()

        def abort() -> None:
            if self.aborted is None:
                self.aborted = f"{what} failed on {store.get(key + '/failed').decode()}"
                dist.distributed_c10d._abort_process_group()

        def watch() -> None:
            while not finished.wait(0.5):
                if store.check([key + "/failed"]):
                    abort()
                    return

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            result = fn()
        except Exception as error:
            # The first failure's rank and reason stay posted; a peer's abort makes others.
            store.compare_set(key + "/failed", "",
                              f"rank {self.rank} ({type(error).__name__}: "
                              f"{str(error).splitlines()[0][:120] if str(error) else ''})")
            abort()
            raise
        finally:
            finished.set()
            watcher.join()
        store.add(key + "/returned", 1)
        while store.add(key + "/returned", 0) < self.world:
            if store.check([key + "/failed"]):
                abort()
                raise RuntimeError(self.aborted)
            time.sleep(0.01)
        return result


class Run:
    """This process's place in the run: rank, device, group, the clock of the budget."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.smoke = args.smoke
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        timeout = datetime.timedelta(seconds=args.timeout_s)
        if self.smoke:
            self.device = torch.device("cpu")
            dist.init_process_group("gloo", timeout=timeout)
        else:
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
            options = dist.ProcessGroupNCCL.Options()
            # NCCL's kernels scheduled ahead of waiting compute blocks as SMs free up.
            options.is_high_priority_stream = args.nccl_high_priority
            dist.init_process_group("nccl", timeout=timeout, device_id=self.device,
                                    pg_options=options)
        self.group = dist.group.WORLD
        self.group_name = self.group.group_name
        self.dtype = torch.bfloat16
        self.start = time.monotonic()
        self.skipped: list[str] = []
        self.every_rank = EveryRank(self.rank, self.world)

    def log(self, text: str) -> None:
        if self.rank == 0:
            print(f"[{time.monotonic() - self.start:6.1f} s] {text}", flush=True)

    def within_budget(self, what: str) -> bool:
        """Whether ``what`` may start: the same answer on every rank."""
        over = torch.tensor([int(time.monotonic() - self.start > self.args.budget_s)],
                            device=self.device)
        dist.all_reduce(over, op=dist.ReduceOp.MAX)
        if over.item():
            self.skipped.append(what)
            self.log(f"skipped (past --budget-s {self.args.budget_s}): {what}")
            return False
        return True

    def slowest(self, seconds: list[float]) -> list[float]:
        """Each value's maximum over ranks."""
        values = torch.tensor(seconds, dtype=torch.float64, device=self.device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return values.tolist()

    def capture(self, fn: Callable[[], object]) -> tuple[Callable[[], None], object]:
        """``fn`` captured in a CUDA graph (warm-up on a side stream first): its
        replay and the outputs it writes. In smoke mode (CPU) ``fn`` itself and the
        outputs of one call."""
        if self.smoke:
            return fn, fn()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the NCCL watchdog thread may query events while this thread captures.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = fn()
        return graph.replay, out

    def time(self, steps: list[Callable[[], object]], warmup: int = 3) -> list[float]:
        """Median seconds of each of ``steps``, run in turn ``replays`` times back to
        back (CUDA events between them, one sync at the end); the slower rank's."""
        replays = self.args.replays or (SMOKE if self.smoke else FULL).replays
        for _ in range(warmup):
            for step in steps:
                step()
        times: list[list[float]] = [[] for _ in steps]
        if self.smoke:
            for _ in range(replays):
                for i, step in enumerate(steps):
                    begin = time.perf_counter()
                    step()
                    times[i].append(time.perf_counter() - begin)
        else:
            torch.cuda.synchronize()
            events = [[torch.cuda.Event(enable_timing=True) for _ in range(len(steps) + 1)]
                      for _ in range(replays)]
            for marks in events:
                marks[0].record()
                for i, step in enumerate(steps):
                    step()
                    marks[i + 1].record()
            torch.cuda.synchronize()
            for marks in events:
                for i in range(len(steps)):
                    times[i].append(marks[i].elapsed_time(marks[i + 1]) * 1e-3)
        return self.slowest([statistics.median(t) for t in times])

    def profile(self, label: str, steps: list[Callable[[], object]],
                wall_s: float) -> dict | None:
        """With ``--profile``: ``--profile-steps`` more runs of ``steps`` in turn (after one
        unprofiled run), under ``torch.profiler`` (CUDA activities; on the smoke path the
        CPU's, its ops standing in for kernels), on every rank, after the timed replays (so
        their times stay the profile's own). Each rank's kernels per step by class
        (`kernel_profile.step_profile`, with ``wall_s``, the timed time of one run of
        ``steps``), the ranks lined up by a barrier just before; kept: the rank whose
        profiled span per step is the longest (``rank``),
        with every rank's busy and span times. ``--profile-traces``: rank 0's chrome trace
        goes to ``OUT/traces/<label>.json``. None without ``--profile``."""
        if not self.args.profile:
            return None
        count = self.args.profile_steps
        for step in steps:
            step()
        self.sync()
        activity = (torch.profiler.ProfilerActivity.CPU if self.smoke
                    else torch.profiler.ProfilerActivity.CUDA)
        # The ranks line up in the profiler's warm-up cycle, which records nothing: a rank
        # whose profiler started first would count its wait for the others as transport.
        lined_up = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
        with torch.profiler.profile(activities=[activity], schedule=lined_up) as prof:
            dist.barrier()
            self.sync()
            prof.step()
            for _ in range(count):
                for step in steps:
                    step()
            self.sync()
            prof.step()
        try:
            found, notes = kernel_profile.kernels(prof, device=not self.smoke)
            mine = {**kernel_profile.step_profile(found, count, wall_s * 1e6), "notes": notes}
        except Exception as error:  # noqa: BLE001 (the table says why; the run goes on)
            mine = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
        if self.args.profile_traces and self.rank == 0:
            folder = os.path.join(self.args.out, "traces")
            os.makedirs(folder, exist_ok=True)
            name = "".join(c if c.isalnum() or c in "=.-" else "_" for c in label)
            prof.export_chrome_trace(os.path.join(folder, f"{name}.json"))
        del prof
        every: list[dict | None] = [None] * self.world
        dist.all_gather_object(every, mine)
        rank = max(range(self.world), key=lambda r: every[r].get("span_us", -1.0))
        return {"label": label, "rank": rank, **every[rank],
                "by_rank": [{"busy_us": p.get("busy_us"), "span_us": p.get("span_us")}
                            for p in every]}

    def sync(self) -> None:
        if not self.smoke:
            torch.cuda.synchronize()

    def release(self) -> None:
        gc.collect()
        if not self.smoke:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


@contextlib.contextmanager
def capacity_check_skipped():
    """Dispatch without its capacity check (an all-reduce and a host read, which a
    CUDA graph cannot capture): only for routing already checked to fit."""
    with unittest.mock.patch.object(collectives, "check_capacity", lambda *_, **__: None):
        yield


def profiled(row: dict, profile: dict | None) -> dict:
    """``row`` with ``profile`` (`Run.profile`) under its key, where there is one."""
    if profile is not None:
        row["profile"] = profile
    return row


def transport_label(row: dict) -> str:
    return (f"transport {row['a2a']} {row['mode']} E={row['experts']} T={row['tokens']} "
            f"C={row['capacity']}")


def available_a2a(run: Run, sizes: Sizes) -> list[str]:
    if run.args.one_rank:
        # supports() refuses one rank (a layer runs a2a "none" there); its ops do not.
        reason = flashinfer_library.device_reason(run.device)
        if reason is not None:
            run.skipped.append(f"a2a flashinfer: {reason}")
        return ["flashinfer"] if reason is None else []
    names = []
    problem = Problem(run.dtype, hidden_size=sizes.hidden, top_k=sizes.top_k, ep_size=run.world)
    for name in A2A_NAMES:
        backend = REGISTRY.a2a.get(name)
        reason = ("not registered" if backend is None else
                  backend.supports(tmo.BackendSpec(a2a=name), problem, run.device))
        if reason is None:
            names.append(name)
        else:
            run.skipped.append(f"a2a {name}: {reason}")
    return [n for n in names if n in run.args.a2a.split(",")]


def release_communicators(a2a: str) -> None:
    """DeepEP's buffers of a case, freed on every rank (low-latency mode holds NVSHMEM,
    which one process initialises for one communicator at a time)."""
    if a2a == "deepep":
        deepep.close_all()
    if a2a == "flashinfer":
        flashinfer_a2a.close_all()


def worst_capacity(tokens: int, top_k: int, num_experts: int, world: int) -> int:
    return worst_case_capacity(tokens, top_k)


def random_routing(run: Run, sizes: Sizes, num_tokens: int, num_experts: int, seed: int):
    """``hidden [T, H]`` bf16, ``topk_weights [T, K]`` fp32 (softmax), ``topk_ids [T, K]``
    int32: K distinct experts per token, uniformly at random, different on each rank."""
    gen = torch.Generator(run.device).manual_seed(seed * 1000 + run.rank)
    hidden_TH = torch.randn(num_tokens, sizes.hidden, generator=gen, device=run.device)
    scores_TE = torch.rand(num_tokens, num_experts, generator=gen, device=run.device)
    topk_ids_TK = scores_TE.topk(sizes.top_k, dim=-1).indices.to(torch.int32)
    topk_weights_TK = torch.randn(num_tokens, sizes.top_k, generator=gen,
                                  device=run.device).softmax(-1)
    return hidden_TH.to(run.dtype), topk_weights_TK, topk_ids_TK


def bytes_sent(a2a: str, run: Run, sizes: Sizes, tokens: int, capacity: int) -> int:
    peers, row = run.world - 1, sizes.hidden * DTYPE_BYTES
    if a2a == "allgather":
        return peers * tokens * (2 * row + 8 * sizes.top_k)
    if a2a == "all_to_all":
        return peers * capacity * (2 * row + 8)
    if a2a == "deepep":
        return peers * tokens * 2 * row
    if a2a == "flashinfer":
        return peers * tokens * (2 * row + 8 * sizes.top_k + 4)
    return 0  # a backend whose formula is not written here: no GB/s


def time_transport(run: Run, sizes: Sizes, a2a: str, num_experts: int, tokens: int,
                   capacity: int, compiled: bool) -> dict:
    """dispatch, then combine of the dispatched rows, each captured; checked once eagerly
    (rows sent back untouched sum to ``hidden * sum_k weight``). ``compiled``: each op
    called from an Inductor-compiled function, as in a compiled model (all_to_all and
    allgather trace their packing into it, around one ordered op per collective), else
    called eagerly."""
    namespace = REGISTRY.a2a[a2a].namespace
    dispatch, combine = op_overload(namespace, "dispatch"), op_overload(namespace, "combine")
    if compiled:
        # Every case has its own sizes: a compile cache of its own.
        torch._dynamo.reset()
        dispatch = torch.compile(dispatch, fullgraph=True, dynamic=False)
        combine = torch.compile(combine, fullgraph=True, dynamic=False)
    ep_args = (run.world, run.group_name, tokens)
    hidden_TH, weights_TK, ids_TK = random_routing(run, sizes, tokens, num_experts, seed=1)
    worst = worst_capacity(tokens, sizes.top_k, num_experts, run.world)
    row = {"a2a": a2a, "mode": "compiled" if compiled else "eager", "experts": num_experts,
           "tokens": tokens, "capacity": capacity,
           "worst_capacity": worst, "even_rows": tokens * sizes.top_k // run.world}
    try:
        x_RH, expert_R, weight_R, src_R, count_E, combine_map_TK = dispatch(
            hidden_TH, weights_TK, ids_TK, num_experts, *ep_args, capacity)
    except RuntimeError as error:
        # Raised on every rank alike: the routing does not fit the capacity.
        row["error"] = str(error).splitlines()[0]
        return row
    out_TH = combine(x_RH, weight_R, src_R, combine_map_TK, *ep_args)
    expected_TH = hidden_TH.float() * weights_TK.sum(-1, keepdim=True)
    row["rel_err"] = ((out_TH.float() - expected_TH).norm() / expected_TH.norm()).item()
    row["rows_received"] = int(count_E.sum())
    del x_RH, expert_R, weight_R, src_R, count_E, combine_map_TK, out_TH, expected_TH

    sent = bytes_sent(a2a, run, sizes, tokens, capacity)
    row.update(bytes_sent=sent, check_in_graph=capacity == worst)
    if a2a in PAIRED_A2A_NAMES:
        def pair():
            x_RH, _, weight_R, src_R, _, combine_map_TK = dispatch(
                hidden_TH, weights_TK, ids_TK, num_experts, *ep_args, capacity)
            return combine(x_RH, weight_R, src_R, combine_map_TK, *ep_args)

        replay_pair, _ = run.capture(pair)
        (total_s,) = run.time([replay_pair])
        row.update(dispatch_us=None, combine_us=None, total_us=total_s * 1e6,
                   gb_per_s=sent / total_s / 1e9 if sent else None)
        profiled(row, run.profile(transport_label(row), [replay_pair], total_s))
        return row
    skip_check = capacity_check_skipped() if capacity < worst else contextlib.nullcontext()
    with skip_check:
        replay_dispatch, dispatched = run.capture(lambda: dispatch(
            hidden_TH, weights_TK, ids_TK, num_experts, *ep_args, capacity))
    x_RH, _, weight_R, src_R, _, combine_map_TK = dispatched
    replay_combine, _ = run.capture(lambda: combine(x_RH, weight_R, src_R, combine_map_TK,
                                                    *ep_args))
    dispatch_s, combine_s = run.time([replay_dispatch, replay_combine])
    row.update(dispatch_us=dispatch_s * 1e6, combine_us=combine_s * 1e6,
               total_us=(dispatch_s + combine_s) * 1e6,
               gb_per_s=sent / (dispatch_s + combine_s) / 1e9 if sent else None)
    profiled(row, run.profile(transport_label(row), [replay_dispatch, replay_combine],
                              dispatch_s + combine_s))
    return row


def time_raw_all_to_all(run: Run, sizes: Sizes, rows_per_peer: int) -> dict:
    """``all_to_all_single`` of ``[P * rows_per_peer, H]`` there and back, each captured."""
    send_QH = torch.randn(run.world * rows_per_peer, sizes.hidden, device=run.device,
                          dtype=run.dtype)
    recv_QH, back_QH = torch.empty_like(send_QH), torch.empty_like(send_QH)
    there, _ = run.capture(lambda: dist.all_to_all_single(recv_QH, send_QH, group=run.group))
    back, _ = run.capture(lambda: dist.all_to_all_single(back_QH, recv_QH, group=run.group))
    there_s, back_s = run.time([there, back])
    sent = 2 * (run.world - 1) * rows_per_peer * sizes.hidden * DTYPE_BYTES
    return profiled({"collective": "all_to_all_single x2", "rows_per_peer": rows_per_peer,
                     "there_us": there_s * 1e6, "back_us": back_s * 1e6,
                     "total_us": (there_s + back_s) * 1e6, "bytes_sent": sent,
                     "gb_per_s": sent / (there_s + back_s) / 1e9},
                    run.profile(f"raw all_to_all_single x2 rows_per_peer={rows_per_peer}",
                                [there, back], there_s + back_s))


def time_raw_gather_scatter(run: Run, sizes: Sizes, tokens: int) -> dict:
    """``all_gather_into_tensor`` of ``[M, H]``, ``reduce_scatter_tensor`` back, each captured."""
    local_MH = torch.randn(tokens, sizes.hidden, device=run.device, dtype=run.dtype)
    gathered_GH = local_MH.new_empty((run.world * tokens, sizes.hidden))
    home_MH = torch.empty_like(local_MH)
    there, _ = run.capture(lambda: dist.all_gather_into_tensor(gathered_GH, local_MH,
                                                               group=run.group))
    back, _ = run.capture(lambda: dist.reduce_scatter_tensor(home_MH, gathered_GH,
                                                             group=run.group))
    there_s, back_s = run.time([there, back])
    sent = 2 * (run.world - 1) * tokens * sizes.hidden * DTYPE_BYTES
    return profiled({"collective": "all_gather + reduce_scatter", "rows_per_peer": tokens,
                     "there_us": there_s * 1e6, "back_us": back_s * 1e6,
                     "total_us": (there_s + back_s) * 1e6, "bytes_sent": sent,
                     "gb_per_s": sent / (there_s + back_s) / 1e9},
                    run.profile(f"raw all_gather + reduce_scatter T={tokens}", [there, back],
                                there_s + back_s))


def round_trip_expected(hidden_TH: torch.Tensor, ids_TK: torch.Tensor, num_experts: int,
                        world: int) -> torch.Tensor:
    """Each token sent once to every rank that holds one of its experts and summed back
    untouched: ``hidden * the ranks it went to`` (fp32)."""
    ranks_TK = ids_TK.long() // (num_experts // world)
    went_TP = torch.zeros(ids_TK.shape[0], world, device=ids_TK.device).scatter_(1, ranks_TK, 1.0)
    return hidden_TH.float() * went_TP.sum(1, keepdim=True)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected).norm() / expected.norm().clamp(min=1e-12)).item()


def time_flashinfer_raw(run: Run, sizes: Sizes, case: tuple[int, int]) -> dict:
    """FlashInfer's own round trip, the yardstick of the flashinfer backend:
    ``MoeAlltoAll.dispatch`` of the payloads the tokens transport sends (activations, fp32 weights,
    int32 ids, which its sanitizer marks at padding, as SGLang runs it) and
    ``MoeAlltoAll.combine`` of the received activations, called directly on a workspace of
    its own, captured as a pair; checked once."""
    from flashinfer.comm import MoeAlltoAll

    num_experts, tokens = case
    lib = flashinfer_a2a.comm_api.api()
    hidden_TH, weights_TK, ids_TK = random_routing(run, sizes, tokens, num_experts, seed=1)
    mapping = lib.Mapping(world_size=run.world, rank=run.rank, gpus_per_node=run.world,
                          tp_size=run.world, moe_ep_size=run.world)
    workspace_bytes = lib.moe_a2a_get_workspace_size_per_rank(
        run.world, tokens,
        flashinfer_sizes.dispatch_bytes_per_token(sizes.hidden, sizes.top_k, run.dtype),
        flashinfer_sizes.combine_bytes_per_token(sizes.hidden, run.dtype))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "MoeAlltoAll is deprecated", DeprecationWarning)
        alltoall = MoeAlltoAll(mapping, tokens, sizes.top_k, num_experts,
                               workspace_size_per_rank=workspace_bytes,
                               mnnvl_config=lib.MnnvlConfig(
                                   comm_backend=lib.TorchDistBackend(run.group)))
    out_TH = torch.empty_like(hidden_TH)

    def pair():
        received = alltoall.dispatch(ids_TK, [hidden_TH, weights_TK, ids_TK], tokens,
                                     invalid_token_expert_id=-1, expert_id_payload_index=2)
        return alltoall.combine(received[0], tokens, output=out_TH)

    error = relative_error(pair(), round_trip_expected(hidden_TH, ids_TK, num_experts,
                                                       run.world))
    replay, _ = run.capture(pair)
    (total_s,) = run.time([replay])
    sent = bytes_sent("flashinfer", run, sizes, tokens, 0)
    return profiled({"collective": "MoeAlltoAll dispatch + combine", "rows_per_peer": tokens,
                     "there_us": None, "back_us": None, "total_us": total_s * 1e6,
                     "bytes_sent": sent, "gb_per_s": sent / total_s / 1e9, "rel_err": error,
                     "workspace_bytes": workspace_bytes},
                    run.profile(f"raw MoeAlltoAll E={num_experts} T={tokens}", [replay],
                                total_s))


def low_latency_runs(run: Run, sizes: Sizes, num_experts: int, tokens: int) -> bool:
    """Whether DeepEP's yardstick at these sizes is its low-latency mode (decode sizes its
    low-latency kernels take), else normal mode."""
    return tokens <= LOW_LATENCY_MAX_TOKENS and deepep_modes.mode_reason(
        deepep_modes.LOW_LATENCY, run.world, sizes.hidden, sizes.top_k,
        num_experts // run.world, tokens) is None


def time_deepep_raw(run: Run, sizes: Sizes, case: tuple[int, int, str]) -> dict:
    """DeepEP's own round trip through its Python API (`peer_deepep`), the yardstick of the
    deepep backend: normal mode (default config and the best of a chunk-size sweep) or
    low-latency mode, on the routing the backend's cases get; checked once."""
    num_experts, tokens, mode = case
    routing = random_routing(run, sizes, tokens, num_experts, seed=1)

    # Normal mode's combine sums what came back; low-latency's weights each slot's row.
    expected_TH = (round_trip_expected(routing[0], routing[2], num_experts, run.world)
                   if mode == "normal" else routing[0].float() * routing[1].sum(-1, keepdim=True))

    def capture_and_time(pair):
        error = relative_error(pair(), expected_TH)
        if error > 1e-2:
            raise RuntimeError(f"DeepEP's own {mode} round trip is off: relative error {error}")
        replay, _ = run.capture(pair)
        (total_s,) = run.time([replay])
        return total_s

    timed = peer_deepep.time_normal if mode == "normal" else peer_deepep.time_low_latency
    row = timed(run, sizes, (num_experts, tokens), routing, capture_and_time)
    release_communicators("deepep")
    sent = (bytes_sent("deepep", run, sizes, tokens, 0) if mode == "normal"
            else masked_bytes_sent(run, sizes, tokens))
    if "total_us" in row:
        row.update(bytes_sent=sent, gb_per_s=sent / row["total_us"] / 1e3,
                   there_us=None, back_us=None)
    return row


def time_tokens(run: Run, sizes: Sizes, a2a: str, num_experts: int, tokens: int,
                compiled: bool) -> dict:
    """The tokens format's transport (what the lowering takes): ``dispatch_tokens``, then
    ``combine_tokens`` of the receive buffers untouched, captured as a pair; checked once.
    ``compiled``: the pair called from one Inductor-compiled function (all_to_all and
    allgather trace their packing into it around one ordered op per collective)."""
    hidden_TH, weights_TK, ids_TK = random_routing(run, sizes, tokens, num_experts, seed=1)
    ep_args = (run.world, run.group_name, tokens)
    namespace = REGISTRY.a2a[a2a].namespace
    dispatch = op_overload(namespace, "dispatch_tokens")
    combine = op_overload(namespace, "combine_tokens")

    def pair():
        x_NH, _, _ = dispatch(hidden_TH, weights_TK, ids_TK, num_experts, *ep_args)
        return combine(x_NH, ids_TK, num_experts, *ep_args)

    if compiled:
        torch._dynamo.reset()
        pair = torch.compile(pair, fullgraph=True, dynamic=False)
    error = relative_error(pair(), round_trip_expected(hidden_TH, ids_TK, num_experts,
                                                       run.world))
    row = {"a2a": a2a, "mode": "tokens, compiled" if compiled else "tokens",
           "experts": num_experts, "tokens": tokens, "capacity": tokens,
           "worst_capacity": tokens, "even_rows": None, "rel_err": error}
    if a2a == "flashinfer":
        (comm,) = flashinfer_a2a.open_communicators()
        row["workspace_bytes"] = comm.workspace_bytes
    replay, _ = run.capture(pair)
    (total_s,) = run.time([replay])
    sent = tokens_bytes_sent(a2a, run, sizes, tokens)
    row.update(bytes_sent=sent, min_bytes=min_bytes(run, sizes, ids_TK, num_experts),
               check_in_graph=True, dispatch_us=None, combine_us=None,
               total_us=total_s * 1e6, gb_per_s=sent / total_s / 1e9)
    return profiled(row, run.profile(transport_label(row), [replay], total_s))


def time_masked(run: Run, sizes: Sizes, a2a: str, num_experts: int, tokens: int) -> dict:
    """The masked format's transport (what the lowering takes for DeepEP at decode sizes):
    ``dispatch_masked``, then ``combine_masked`` of the receive blocks untouched, captured
    as a pair; checked once (each slot's row comes back weighted: ``hidden * sum_k w``)."""
    hidden_TH, weights_TK, ids_TK = random_routing(run, sizes, tokens, num_experts, seed=1)
    ep_args = (run.world, run.group_name, tokens)
    namespace = REGISTRY.a2a[a2a].namespace
    dispatch = op_overload(namespace, "dispatch_masked")
    combine = op_overload(namespace, "combine_masked")

    def pair():
        x_EQH, _, src_info_EQ, layout_range_EP = dispatch(hidden_TH, weights_TK, ids_TK,
                                                          num_experts, *ep_args)
        return combine(x_EQH, src_info_EQ, layout_range_EP, weights_TK, ids_TK, num_experts,
                       *ep_args)

    error = relative_error(pair(), hidden_TH.float() * weights_TK.sum(-1, keepdim=True))
    replay, _ = run.capture(pair)
    (total_s,) = run.time([replay])
    sent = masked_bytes_sent(run, sizes, tokens)
    row = {"a2a": a2a, "mode": "masked", "experts": num_experts, "tokens": tokens,
           "capacity": tokens, "worst_capacity": tokens, "even_rows": None,
           "rel_err": error, "bytes_sent": sent, "check_in_graph": True,
           "dispatch_us": None, "combine_us": None, "total_us": total_s * 1e6,
           "gb_per_s": sent / total_s / 1e9}
    return profiled(row, run.profile(transport_label(row), [replay], total_s))


def masked_bytes_sent(run: Run, sizes: Sizes, tokens: int) -> int:
    """What one rank sends its peers in the masked format, at uniform routing: a row per
    (token, slot) whose expert is on another rank ((P - 1) / P of the K), there and back."""
    return (run.world - 1) * tokens * sizes.top_k * 2 * sizes.hidden * DTYPE_BYTES // run.world


def tokens_bytes_sent(a2a: str, run: Run, sizes: Sizes, tokens: int) -> int:
    """What one rank sends its peers in the tokens format: M rows with ids and weights
    there, M rows back (flashinfer and deepep: each token once per rank that needs it; the
    same at these sizes). DeepEP's ids are int64."""
    id_bytes = 8 if a2a == "deepep" else 4
    return (run.world - 1) * tokens * (2 * sizes.hidden * DTYPE_BYTES
                                       + (4 + id_bytes) * sizes.top_k)


def min_bytes(run: Run, sizes: Sizes, ids_TK: torch.Tensor, num_experts: int) -> int:
    """The per-token minimum: each token's row to each other rank that holds one of its
    experts, and back (this rank's routing)."""
    rank_TK = ids_TK.long() // (num_experts // run.world)
    goes_TP = torch.zeros(ids_TK.shape[0], run.world, dtype=torch.bool, device=ids_TK.device)
    goes_TP.scatter_(1, rank_TK, True)
    goes_TP[:, run.rank] = False
    return int(goes_TP.sum()) * 2 * sizes.hidden * DTYPE_BYTES


@dataclasses.dataclass
class Results:
    """What the run measured so far; rank 0 writes it after every case, so a run cut
    short by a time limit keeps the cases it finished."""

    transport: list = dataclasses.field(default_factory=list)
    raw: dict = dataclasses.field(default_factory=dict)
    layers: list = dataclasses.field(default_factory=list)

    def save(self, run: Run, sizes: Sizes) -> str:
        """Writes ``ep.json``, ``ep.md`` and ``summary.txt`` (rank 0); returns the summary."""
        if run.rank != 0:
            return ""
        header = write_results(run, sizes, self.transport, self.raw, self.layers)
        summary = f"{header}\n{FORMULAS}\n" + short_table(self.transport, self.layers)
        with open(os.path.join(run.args.out, "summary.txt"), "w") as f:
            f.write(summary + "\n")
        return summary


def transport_phase(run: Run, sizes: Sizes, a2a_names: list[str], results: Results) -> None:
    """Every (experts, tokens, backend, capacity) case and the raw collectives they
    are judged against (keyed by their sizes: raw transport does not depend on E)."""
    rows, raw = results.transport, results.raw

    def raw_case(key, fn, size, label):
        if key not in raw and run.within_budget(f"raw {key}"):
            raw[key] = {"for": label, **fn(run, sizes, size)}
            run.release()
        return raw.get(key)

    def judged(row, base):
        """``row`` against its yardstick, kept and logged."""
        if base is not None and "total_us" in row:
            row["raw_us"] = base["total_us"]
            row["vs_raw"] = row["total_us"] / base["total_us"]
        rows.append(row)
        results.save(run, sizes)
        run.log(transport_line(row))

    for num_experts in sizes.experts:
        for tokens in sizes.tokens:
            worst = worst_capacity(tokens, sizes.top_k, num_experts, run.world)
            even = tokens * sizes.top_k // run.world
            reduced = min(worst, math.ceil(run.args.capacity_factor * even))
            for a2a in a2a_names:
                capacities = [worst] + ([reduced] if a2a in CAPACITY_A2A_NAMES
                                        and reduced < worst else [])
                modes = (False,) if a2a in EAGER_ONLY_A2A_NAMES else (True, False)
                if run.args.tokens_only and a2a in TOKENS_A2A_NAMES:
                    capacities = []
                for capacity, compiled in itertools.product(capacities, modes):
                    what = f"transport {a2a} E={num_experts} T={tokens} C={capacity}"
                    if not run.within_budget(what):
                        continue
                    row = time_transport(run, sizes, a2a, num_experts, tokens, capacity,
                                         compiled)
                    release_communicators(a2a)
                    run.release()
                    if a2a == "allgather":
                        base = raw_case(("ag+rs", tokens), time_raw_gather_scatter, tokens,
                                        f"allgather, T={tokens}")
                    elif a2a == "flashinfer":
                        base = raw_case(("flashinfer", num_experts, tokens),
                                        time_flashinfer_raw, (num_experts, tokens),
                                        f"flashinfer, E={num_experts}, T={tokens}")
                    else:
                        base = raw_case(("a2a", capacity), time_raw_all_to_all, capacity,
                                        f"capacity {capacity} (T={tokens})")
                    judged(row, base)
                for compiled in (False,) if a2a in EAGER_ONLY_A2A_NAMES else (True,):
                    what = f"transport {a2a} tokens E={num_experts} T={tokens}"
                    if a2a not in TOKENS_A2A_NAMES or not run.within_budget(what):
                        continue
                    row = time_tokens(run, sizes, a2a, num_experts, tokens, compiled)
                    release_communicators(a2a)
                    run.release()
                    # Judged against one row per token per peer; flashinfer and deepep
                    # against their engine's own round trip (deepep: low-latency at decode
                    # sizes, normal mode above, each also timed in the other mode).
                    if a2a == "flashinfer":
                        base = raw_case(("flashinfer", num_experts, tokens),
                                        time_flashinfer_raw, (num_experts, tokens),
                                        f"flashinfer, E={num_experts}, T={tokens}")
                    elif a2a == "deepep":
                        modes = ["normal"] + (["low_latency"] if low_latency_runs(
                            run, sizes, num_experts, tokens) else [])
                        bases = [raw_case(("deepep", num_experts, tokens, m), time_deepep_raw,
                                          (num_experts, tokens, m),
                                          f"deepep {m}, E={num_experts}, T={tokens}")
                                 for m in modes]
                        base = bases[-1]
                    else:
                        base = raw_case(("a2a", tokens), time_raw_all_to_all, tokens,
                                        f"one row per token per peer, T={tokens}")
                    judged(row, base)
                what = f"transport {a2a} masked E={num_experts} T={tokens}"
                if (a2a in MASKED_A2A_NAMES and low_latency_runs(run, sizes, num_experts, tokens)
                        and run.within_budget(what)):
                    row = time_masked(run, sizes, a2a, num_experts, tokens)
                    release_communicators(a2a)
                    run.release()
                    # Judged against DeepEP's own low-latency round trip of the same payloads.
                    judged(row, raw_case(("deepep", num_experts, tokens, "low_latency"),
                                         time_deepep_raw, (num_experts, tokens, "low_latency"),
                                         f"deepep low_latency, E={num_experts}, T={tokens}"))
            raw_case(("a2a", even), time_raw_all_to_all, even, f"even share, T={tokens}")


def moe_config(sizes: Sizes, world: int, tokens: int, shared: int) -> tmo.MoEConfig:
    """The layer of the layer phase: with a shared expert of intermediate size ``shared``
    (0: none), which an inference layer at prefill sizes runs while its tokens travel."""
    return tmo.MoEConfig(hidden_size=sizes.hidden, intermediate_size=sizes.inter,
                         num_experts=sizes.layer_experts, top_k=sizes.top_k,
                         scoring="softmax", renormalize=True, ep_size=world,
                         max_tokens_per_rank=tokens,
                         shared_expert_intermediate_size=shared)


def time_local_experts(run: Run, sizes: Sizes, moe: tmo.MoE, tokens: int) -> dict:
    """``moe::experts_rows`` on this rank's experts and the rows an all_to_all dispatch of
    uniformly random routing delivers at the layer's capacity, captured."""
    cfg = moe.cfg
    hidden_TH, weights_TK, ids_TK = random_routing(run, sizes, tokens, cfg.num_experts, seed=2)
    dispatch = op_overload(REGISTRY.a2a["all_to_all"].namespace, "dispatch")
    with torch.no_grad():
        x_RH, expert_R, _, _, count_E, _ = dispatch(
            hidden_TH, weights_TK, ids_TK, cfg.num_experts, run.world, run.group_name,
            cfg.max_tokens_per_rank, cfg.rows_per_rank)
        del hidden_TH
        args = (x_RH, expert_R, count_E, moe.w13.detach(), moe.w2.detach(), None, None,
                cfg.activation, cfg.static_float("swiglu_alpha"),
                cfg.static_float("swiglu_limit"))
        replay, _ = run.capture(lambda: torch.ops.moe.experts_rows(*args))
        (seconds,) = run.time([replay])
        profile = run.profile(f"local experts E_l={cfg.num_experts // run.world} T={tokens}",
                              [replay], seconds)
    return {"local_us": seconds * 1e6, "rows": x_RH.shape[0], "real_rows": int(count_E.sum()),
            **({"local_profile": profile} if profile else {})}


def time_layer(run: Run, sizes: Sizes, moe: tmo.MoE, a2a: str, tokens: int,
               chunks: int | None) -> dict:
    """The compiled layer's forward, its tokens in ``chunks`` (`tmo.backend`): CUDA graphs of
    ``reduce-overhead`` timed per call, else Inductor without them captured by hand; checked
    once against eager."""
    gen = torch.Generator(run.device).manual_seed(3000 + run.rank)
    x_TH = torch.randn(tokens, sizes.hidden, generator=gen, device=run.device).to(run.dtype)
    counters = torch._dynamo.utils.counters
    row: dict = {}
    with torch.no_grad():
        expected_TH = moe(x_TH)
        attempts = [("smoke: aot_eager", dict(inner="aot_eager"))] if run.smoke else [
            ("reduce-overhead", dict(mode="reduce-overhead")), ("inductor + graph", {})]
        for how, options in attempts:
            torch._dynamo.reset()
            counters.clear()
            compiled = torch.compile(moe, backend=tmo.backend(
                a2a=a2a, chunks=chunks, overlap=run.args.overlap, **options),
                fullgraph=True, dynamic=False)
            begin = time.monotonic()
            try:
                if how == "reduce-overhead":
                    def step(compiled=compiled):
                        torch.compiler.cudagraph_mark_step_begin()
                        return compiled(x_TH)
                    out_TH = step().clone()
                    row["compile_s"] = time.monotonic() - begin
                    (seconds,) = run.time([step])
                    timed = step
                    skips = counters["inductor"]["cudagraph_skips"]
                    if skips:
                        how += f" (cudagraph skipped {skips}x)"
                else:
                    out_TH = compiled(x_TH).clone()
                    row["compile_s"] = time.monotonic() - begin
                    replay, _ = run.capture(lambda compiled=compiled: compiled(x_TH))
                    (seconds,) = run.time([replay])
                    timed = replay
            except Exception as error:  # noqa: BLE001 (the next way is tried, the error kept)
                row.setdefault("errors", []).append(f"{how}: {type(error).__name__}: "
                                                    f"{str(error).splitlines()[0][:200]}")
                run.log(f"layer {a2a} T={tokens} {how} failed: {row['errors'][-1]}")
                continue
            err = ((out_TH.float() - expected_TH.float()).norm()
                   / expected_TH.float().norm().clamp(min=1e-12)).item()
            if run.args.overlap:
                how += ", overlap"
            row.update(how=how, layer_us=seconds * 1e6, rel_err_vs_eager=err)
            profiled(row, run.profile(f"layer {a2a} T={tokens} x{chunks or 'auto'} "
                                      f"shared={run.args.shared} {how}", [timed], seconds))
            break
    torch._dynamo.reset()
    return row


def planned_chunks(run: Run, cfg: tmo.MoEConfig, a2a: str, asked: list[int | None]
                   ) -> list[int]:
    """The chunk counts > 1 the plan takes for an inference layer of ``cfg`` for each of
    ``asked`` (None: its own choice), each once."""
    problem = dataclasses.replace(Problem.from_config(cfg, run.dtype), training=False)
    taken = [plan_layer(tmo.BackendSpec(a2a=a2a, chunks=chunks), problem, run.device).chunks
             for chunks in asked]
    return sorted({chunks for chunks in taken if chunks > 1})


def layer_phase(run: Run, sizes: Sizes, a2a_names: list[str], results: Results,
                asked_chunks: list[int | None]) -> None:
    rows, raw = results.layers, results.raw
    for tokens in sizes.layer_tokens:
        if not run.within_budget(f"layer T={tokens}"):
            continue
        cfg = moe_config(sizes, run.world, tokens, run.args.shared)
        torch.manual_seed(0)  # the router and experts alike on every rank
        moe = tmo.MoE(cfg, device=run.device, dtype=run.dtype, ep_group=run.group)
        experts = REGISTRY.choose_experts(tmo.BackendSpec(), Problem.from_config(cfg, run.dtype),
                                          run.device).name
        local = time_local_experts(run, sizes, moe, tokens)
        run.release()
        for a2a in a2a_names:
            if not run.within_budget(f"layer {a2a} T={tokens}"):
                continue
            fmt = plan_layer(tmo.BackendSpec(a2a=a2a), dataclasses.replace(
                Problem.from_config(cfg, run.dtype), training=False), run.device).format.name
            # The engine's own round trip of what the plan's format moves.
            deepep_mode = ("low_latency" if low_latency_runs(run, sizes, cfg.num_experts, tokens)
                           else "normal")
            key = {"allgather": ("ag+rs", tokens),
                   "flashinfer": ("flashinfer", cfg.num_experts, tokens),
                   "deepep": ("deepep", cfg.num_experts, tokens, deepep_mode)}.get(
                a2a, ("a2a", tokens if fmt == "tokens" else cfg.rows_per_rank))
            if fmt == "masked":
                key = ("deepep", cfg.num_experts, tokens, "low_latency")
            # Chunks of a decode-sized batch each read every expert's weights again: the
            # asked counts run at the prefill size only.
            asked = asked_chunks if tokens == max(sizes.layer_tokens) else []
            for chunks in [1, *planned_chunks(run, cfg, a2a, asked)]:
                if chunks > 1 and not run.within_budget(f"layer {a2a} T={tokens} x{chunks}"):
                    continue
                row = {"a2a": a2a, "experts_backend": experts, "tokens": tokens, "format": fmt,
                       "shared": run.args.shared,
                       "capacity": cfg.rows_per_rank if fmt == "rows" else tokens,
                       "chunks": chunks, **local,
                       **time_layer(run, sizes, moe, a2a, tokens, chunks)}
                if key in raw:
                    row["raw_us"] = raw[key]["total_us"]
                if "layer_us" in row and "raw_us" in row:
                    row["vs_local_plus_raw"] = row["layer_us"] / (row["local_us"]
                                                                  + row["raw_us"])
                rows.append(row)
                results.save(run, sizes)
                run.log(layer_line(row))
                release_communicators(a2a)
                run.release()
        del moe
        run.release()


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def transport_line(row: dict) -> str:
    if "error" in row:
        return (f"transport {row['a2a']} E={row['experts']} T={row['tokens']} "
                f"C={row['capacity']}: {row['error']}")
    return (f"transport {row['a2a']} {row['mode']} E={row['experts']} T={row['tokens']} "
            f"C={row['capacity']}: "
            f"{row['total_us']:.1f} us, {_fmt(row.get('gb_per_s'))} GB/s, "
            f"{_fmt(row.get('vs_raw'), '.2f')}x raw")


def layer_line(row: dict) -> str:
    return (f"layer {row['a2a']} T={row['tokens']} x{row['chunks']} "
            f"({row.get('how', 'failed')}): "
            f"{_fmt(row.get('layer_us'))} us, local experts {row['local_us']:.1f} us, "
            f"raw {_fmt(row.get('raw_us'))} us, {_fmt(row.get('vs_local_plus_raw'), '.2f')}x")


def transport_table(rows: list[dict]) -> str:
    lines = [(f"| a2a | mode | E | T/rank | C (worst) | dispatch us | combine us | total us | "
              f"MB sent | GB/s | raw us | vs raw (all_to_all target <= {TARGET_TRANSPORT} "
              f"vs NCCL; flashinfer tokens <= {TARGET_FLASHINFER} vs MoeAlltoAll; deepep tokens <= "
              f"{TARGET_DEEPEP} vs DeepEP's own) | rel err | "
              f"note |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['a2a']} | {r['mode']} | {r['experts']} | {r['tokens']} | "
                         f"{r['capacity']} ({r['worst_capacity']}) | | | | | | | | | "
                         f"{r['error']} |")
            continue
        note = "" if r["check_in_graph"] else "routing checked eagerly; graph without the check"
        lines.append(
            f"| {r['a2a']} | {r['mode']} | {r['experts']} | {r['tokens']} | {r['capacity']} "
            f"({r['worst_capacity']}) | {_fmt(r['dispatch_us'])} | {_fmt(r['combine_us'])} | "
            f"{r['total_us']:.1f} | {r['bytes_sent'] / 1e6:.1f}{_of_minimum(r)} | "
            f"{_fmt(r['gb_per_s'])} | "
            f"{_fmt(r.get('raw_us'))} | {_fmt(r.get('vs_raw'), '.2f')} | "
            f"{r['rel_err']:.1e} | {note} |")
    return "\n".join(lines)


def _of_minimum(row: dict) -> str:
    """`` (Nx min)``: the bytes sent over the per-token minimum, where it is known."""
    return f" ({row['bytes_sent'] / row['min_bytes']:.2f}x min)" if row.get("min_bytes") else ""


def raw_table(raw: dict) -> str:
    lines = ["| collective | for | rows per peer | there us | back us | total us | MB | GB/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in raw.values():
        tuned = (f" ({r['num_sms']} SMs; the backend's config {r['default_us']:.1f} us; NVL "
                 f"chunks {r['dispatch_chunk']}/{r['combine_chunk']}: {r['tuned_us']:.1f} us)"
                 if "tuned_us" in r else "")
        lines.append(f"| {r['collective']}{tuned} | {r['for']} | {r['rows_per_peer']} | "
                     f"{_fmt(r['there_us'])} | "
                     f"{_fmt(r['back_us'])} | {r['total_us']:.1f} | "
                     f"{r['bytes_sent'] / 1e6:.1f} | {r['gb_per_s']:.1f} |")
    return "\n".join(lines)


def layer_table(rows: list[dict]) -> str:
    lines = [(f"| a2a | format | experts | T/rank | C | shared I | chunks | how | compile s | "
              f"layer us | "
              f"local experts us (real rows) | raw transport us | layer / (local + raw) (target <= "
              f"{TARGET_LAYER}; with a shared expert at T=4096 <= {TARGET_SHARED_HIDDEN}; in "
              f"chunks at T=4096 <= {TARGET_OVERLAP}) | rel err vs eager | "
              f"errors |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['a2a']} | {r.get('format')} | {r['experts_backend']} | {r['tokens']} | "
            f"{r['capacity']} | {r['shared'] or '-'} | {r['chunks']} | "
            f"{r.get('how', 'failed')} | {_fmt(r.get('compile_s'))} | "
            f"{_fmt(r.get('layer_us'))} | {r['local_us']:.1f} ({r['real_rows']}) | "
            f"{_fmt(r.get('raw_us'))} | {_fmt(r.get('vs_local_plus_raw'), '.2f')} | "
            f"{_fmt(r.get('rel_err_vs_eager'), '.1e')} | {'; '.join(r.get('errors', []))} |")
    return "\n".join(lines)


def profile_section(run: Run, transport: list, raw: dict, layers: list) -> str:
    """``--profile``'s tables, one per profiled row, in the order the rows ran."""
    profiles = [r["profile"] for r in [*transport, *raw.values(), *layers] if "profile" in r]
    seen = set()
    for r in layers:  # the local experts of each token count, once
        local = r.get("local_profile")
        if local is not None and local["label"] not in seen:
            seen.add(local["label"])
            profiles.append(local)
    unit = "CPU (smoke: ops stand in for kernels, threads for streams)" if run.smoke else "GPU"
    parts = [(f"## profile: kernels per step by class ({unit})\n\n"
             "Each row's kernels over its profiled steps (run after its timed replays), on "
             "the rank whose profiled span per step is the longest. Classes by kernel name "
             "(`kernel_profile.CLASSES`): transport (NCCL, DeepEP, FlashInfer a2a), GEMM, "
             "Triton kernels by name, sort/topk, reduction/sum, copy/pack/gather/index, "
             "other. us concurrent with transport: the class's time while a transport kernel "
             "ran (on another stream); overlap: transport time while any other kernel ran.")]
    for p in profiles:
        ranks = ", ".join(f"{_fmt(b['busy_us'])}/{_fmt(b['span_us'])}" for b in p["by_rank"])
        heading = (f"### {p['label']}\n\nrank {p['rank']} (busy/span us per step by rank: "
                   f"{ranks})")
        body = (f"profile failed: {p['error']}" if "error" in p
                else kernel_profile.step_table(p, "CPU" if run.smoke else "GPU"))
        parts.append(f"{heading}\n\n{body}")
    return "\n\n".join(parts)


FORMULAS = """Bytes one rank sends its peers (GB/s = bytes / time; P ranks, capacity C, M = T, b=2):
    all_to_all  (P-1) * C * (2*H*b + 8)    allgather  (P-1) * M * (2*H*b + 8*K)
    deepep      (P-1) * M * 2*H*b (each token to each peer at most once, there and back;
                tokens: + 12*K, its int64 ids and fp32 weights)
    flashinfer  (P-1) * M * (2*H*b + 8*K + 4) (the same, with ids, weights and token index)
    raw a2a     2 * (P-1) * C * H * b      raw ag+rs  2 * (P-1) * M * H * b"""


def short_table(transport: list[dict], layers: list[dict]) -> str:
    lines = [f"{'case':44} {'us':>9} {'GB/s':>7} {'vs base':>8}"]
    for r in transport:
        if "error" in r:
            continue
        mode = "".join(word[0] for word in r["mode"].split())
        case = f"{r['a2a']} {mode} E={r['experts']} T={r['tokens']} C={r['capacity']}"
        lines.append(f"{case:44} {r['total_us']:9.1f} {_fmt(r['gb_per_s']):>7} "
                     f"{_fmt(r.get('vs_raw'), '.2f'):>8}")
    for r in layers:
        case = f"layer {r['a2a']} T={r['tokens']} x{r['chunks']} ({r.get('how', 'failed')})"
        lines.append(f"{case:44} {_fmt(r.get('layer_us')):>9} {'':>7} "
                     f"{_fmt(r.get('vs_local_plus_raw'), '.2f'):>8}")
    lines.append(f"vs base: transport / raw NCCL same bytes (all_to_all target <= "
                 f"{TARGET_TRANSPORT}); flashinfer / MoeAlltoAll's own round trip, same "
                 f"payloads (tokens target <= {TARGET_FLASHINFER}); deepep masked / DeepEP's "
                 f"own low-latency round trip (target <= {TARGET_DEEPEP_LOW_LATENCY}); "
                 f"layer / (local experts + raw transport) (target <= {TARGET_LAYER}; with a "
                 f"shared expert at T=4096 <= {TARGET_SHARED_HIDDEN}; xC: tokens in C chunks, "
                 f"target at T=4096 <= {TARGET_OVERLAP})")
    return "\n".join(lines)


def meta(run: Run, sizes: Sizes) -> dict:
    info = {"date": str(datetime.date.today()), "torch": torch.__version__,
            "python": platform.python_version(), "ranks": run.world,
            "dtype": str(run.dtype).removeprefix("torch."), "sizes": dataclasses.asdict(sizes),
            "capacity_factor": run.args.capacity_factor, "smoke": run.smoke,
            "nccl_high_priority": run.args.nccl_high_priority,
            "deepep_sms": deepep.configs.NUM_SMS,
            "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE",
                                                  "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                  "NVSHMEM_DISABLE_NVLS")}}
    if run.smoke:
        info["device"] = f"CPU ({platform.processor() or platform.machine()}), gloo"
    else:
        info["device"] = torch.cuda.get_device_name(run.device)
        version = torch.cuda.nccl.version()
        info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return info


def write_results(run: Run, sizes: Sizes, transport: list, raw: dict, layers: list) -> str:
    info = meta(run, sizes)
    os.makedirs(run.args.out, exist_ok=True)
    with open(os.path.join(run.args.out, "ep.json"), "w") as f:
        json.dump({"meta": info, "formulas": FORMULAS,
                   "targets": {"all_to_all_vs_raw": TARGET_TRANSPORT,
                               "flashinfer_tokens_vs_moe_alltoall": TARGET_FLASHINFER,
                               "deepep_tokens_vs_deepep": TARGET_DEEPEP,
                               "deepep_masked_vs_deepep_low_latency": TARGET_DEEPEP_LOW_LATENCY,
                               "layer_vs_local_plus_raw": TARGET_LAYER,
                               "shared_layer_vs_local_plus_raw_at_4096": TARGET_SHARED_HIDDEN,
                               "chunked_layer_vs_local_plus_raw_at_4096": TARGET_OVERLAP},
                   "transport": transport, "raw": list(raw.values()), "layer": layers,
                   "skipped": run.skipped}, f, indent=1)
    header = (f"{info['device']}, {info['date']}, torch {info['torch']}, "
              f"NCCL {info.get('nccl', '-')}, {run.world} ranks, {info['dtype']}, "
              f"H={sizes.hidden}, K={sizes.top_k}, uniformly random routing; DeepEP's "
              f"normal mode on {info['deepep_sms']} SMs"
              + ("; NCCL streams at high priority" if info["nccl_high_priority"] else ""))
    text = "\n\n".join([
        f"# Expert-parallel transport and layer step\n\n{header}",
        (f"Targets: all_to_all dispatch + combine within {TARGET_TRANSPORT}x raw NCCL on the "
         f"same bytes; deepep within {TARGET_DEEPEP}x DeepEP's own round trip (masked: "
         f"{TARGET_DEEPEP_LOW_LATENCY}x); layer step <= {TARGET_LAYER}x (local experts + raw "
         f"transport), <= {TARGET_SHARED_HIDDEN}x with a shared expert at T=4096. Times: "
         + ("median of eager calls (smoke: tiny sizes on the CPU, not a measurement)"
            if run.smoke else "median of CUDA-graph replays timed with CUDA events")
         + ", the slower rank's."),
        "```\n" + FORMULAS + "\n```",
        "## dispatch + combine\n\n" + transport_table(transport),
        f"## raw {'gloo (eager)' if run.smoke else 'NCCL (CUDA graphs)'}\n\n" + raw_table(raw),
        f"## layer step (H={sizes.hidden}, I={sizes.inter}, E={sizes.layer_experts}, "
        f"K={sizes.top_k}, softmax)\n\n" + layer_table(layers),
        *([profile_section(run, transport, raw, layers)] if run.args.profile else []),
        *([("Skipped: " + "; ".join(run.skipped))] if run.skipped else []),
    ])
    with open(os.path.join(run.args.out, "ep.md"), "w") as f:
        f.write(text + "\n")
    return header


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for ep.json and ep.md")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on the CPU over gloo, eager timing: checks the script")
    parser.add_argument("--a2a", default=",".join(A2A_NAMES), help="comma-separated backends")
    parser.add_argument("--replays", type=int, default=0, help="timed replays (0: default)")
    parser.add_argument("--capacity-factor", type=float, default=1.25,
                        help="the smaller all_to_all capacity, in even shares T*K/P")
    parser.add_argument("--experts", default="",
                        help="comma-separated expert counts of the transport phase "
                             "(default: 64,256; smoke: 8)")
    parser.add_argument("--no-layer", action="store_true", help="skip the layer phase")
    parser.add_argument("--chunks", default="auto", type=chunk_counts,
                        help="comma-separated chunk counts of the layer rows moved in chunks, "
                             "beside the whole layer's ('auto': the plan's own choice; '': "
                             "none)")
    parser.add_argument("--deepep-sms", type=int, default=None,
                        help="SMs of DeepEP's normal-mode kernels, for the backend and its "
                             "yardstick alike (`deepep.set_num_sms`; default: the backend's)")
    parser.add_argument("--nccl-high-priority", action="store_true",
                        help="the NCCL process group's streams at high priority "
                             "(ProcessGroupNCCL.Options.is_high_priority_stream): its "
                             "transfers' blocks start before compute running beside them")
    parser.add_argument("--overlap", action="store_true",
                        help="tmo.backend(overlap=True): the layer's transfers in flight under "
                             "the work that needs no routed tokens (its shared expert), where "
                             "the plan takes it")
    parser.add_argument("--shared", type=int, default=0,
                        help="intermediate size of the layer's shared expert (DeepSeek-V3: "
                             "2048; 0: none): vs_local_plus_raw then says how much of it the "
                             "transfers hide (local_us times the routed experts alone)")
    parser.add_argument("--tokens-only", action="store_true",
                        help="time only the tokens format of the backends that have it")
    parser.add_argument("--profile", action="store_true",
                        help="after each timed row, --profile-steps more runs under "
                             "torch.profiler: kernels per step by class, their streams and "
                             "the transport's overlap with other kernels, in ep.md")
    parser.add_argument("--profile-steps", type=int, default=5,
                        help="profiled runs per row (with --profile)")
    parser.add_argument("--profile-traces", action="store_true",
                        help="with --profile: rank 0's chrome trace of each profiled row "
                             "in OUT/traces (large files)")
    parser.add_argument("--timeout-s", type=float, default=240,
                        help="process-group timeout: the longest any collective waits")
    parser.add_argument("--budget-s", type=float, default=210,
                        help="no case starts after this many seconds")
    parser.add_argument("--one-rank", action="store_true",
                        help="one process on one GPU: the flashinfer transport cases at P=1 "
                             "(the backend's cost over FlashInfer's round trip), no layer")
    args = parser.parse_args(argv)
    if args.deepep_sms is not None:
        try:
            deepep.set_num_sms(args.deepep_sms)
        except ValueError as error:
            parser.error(f"argument --deepep-sms: {error}")
    return args


def chunk_counts(text: str) -> list[int | None]:
    """``--chunks``: each count, None for ``auto``; for anything else an error that argparse
    reports before any case runs."""
    counts = []
    for word in filter(None, text.split(",")):
        if word != "auto" and not (word.isdigit() and int(word) >= 1):
            raise argparse.ArgumentTypeError(
                f"takes comma-separated positive ints or 'auto', got {text!r}")
        counts.append(None if word == "auto" else int(word))
    return counts


def check_launch(args: argparse.Namespace) -> None:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        sys.exit("bench_ep.py runs one process per GPU: launch it with "
                 "`torchrun --nproc-per-node 2 benchmarks/bench_ep.py --out DIR` "
                 "(add --smoke for a CPU check over gloo)")
    world = int(os.environ["WORLD_SIZE"])
    if args.one_rank and (world != 1 or args.smoke):
        sys.exit(f"--one-rank runs one process on one GPU: launch it with --nproc-per-node 1 "
                 f"and without --smoke, got WORLD_SIZE={world}"
                 f"{' and --smoke' if args.smoke else ''}")
    if world < 2 and not args.one_rank:
        sys.exit(f"expert parallelism needs >= 2 ranks, got WORLD_SIZE={world} "
                 f"(--one-rank times the flashinfer backend's own cost on one GPU)")
    if not args.smoke:
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < world:
            sys.exit(f"bench_ep.py needs {world} CUDA GPUs (one per rank), found {found}; "
                     "--smoke runs tiny sizes on the CPU over gloo")
        if dist.is_available() and not dist.is_nccl_available():
            sys.exit("bench_ep.py needs NCCL: this torch has none")


def main(argv=None) -> None:
    # torch 2.13 renames all_gather_into_tensor / reduce_scatter_tensor (*_single); 2.11
    # has only these names.
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use `torch.distributed",
                            category=FutureWarning)
    args = parse_args(argv)
    check_launch(args)
    run = Run(args)
    sizes = SMOKE if args.smoke else FULL
    if args.experts:
        sizes = dataclasses.replace(sizes, experts=tuple(int(e) for e in args.experts.split(",")))
    try:
        a2a_names = available_a2a(run, sizes)
        run.log(f"a2a backends: {', '.join(a2a_names) or 'none'}; skipped: "
                f"{'; '.join(run.skipped) or 'none'}")
        results = Results()
        transport_phase(run, sizes, a2a_names, results)
        if not (args.no_layer or args.one_rank):
            layer_phase(run, sizes, a2a_names, results, args.chunks)
        summary = results.save(run, sizes)
        if run.rank == 0:
            print("\n" + summary, flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
