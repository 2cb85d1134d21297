"""Compiled expert-parallel layers on CPU processes (gloo) whose ranks hold 0, 1 or many
tokens, in one step and across steps, under every ``dynamic`` mode of ``torch.compile``, on
every transport (DeepEP and FlashInfer through their emulators): no rank is left waiting in
a collective, and every rank's output equals the single-process layer's on its tokens. A
layer with ``ep_capacity`` below the worst case keeps it (rows) or raises on every rank.

Dynamo specializes sizes 0 and 1: under ``dynamic=True`` a rank of 0 or 1 tokens compiles a
graph of fixed sizes while its peers compile a symbolic token count, and the default mode
turns dynamic at a rank's second count. The graphs must still run the same collectives in
the same order on every rank (`common.transport.collectives`).

Legend: P ranks, T tokens of one rank, N tokens of all ranks, H hidden size.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import deepep_emulator
import flashinfer_a2a_emulator
import torch_moe_ops as tmo
from distributed import run_on_ranks, skip_without_gpus
from ep_problems import check_bf16_out, cpu_single_and_sharded, token_slice
from torch_moe_ops.backends.registry import REGISTRY, Problem
from torch_moe_ops.config import BackendSpec

H, I, K, M = 16, 8, 2, 8
# A hidden size DeepEP's low-latency kernels are built for (the emulator checks it).
DEEPEP_H = 2048
# Each step's tokens per rank: 0, 1 and many in one step, and each rank's count changing
# across steps (a rank's first count 1 or 0, then many, then 0 or 1 again).
STEPS = {2: ((3, 1), (1, 0), (5, 2), (0, 4), (6, 1)),
         3: ((3, 1, 0), (0, 5, 1), (1, 0, 4), (2, 3, 6)),
         4: ((3, 1, 0, 2), (0, 5, 1, 1), (4, 0, 0, 7))}
DYNAMIC = (True, False, None)
# The whole run stays far inside the launcher's deadline: a collective that no peer joins
# fails the test within this.
TIMEOUT = datetime.timedelta(seconds=120)


def _run_steps(rank, single, sharded, hidden, a2a, dynamic, dtype, train, chunks=None):
    """``sharded`` compiled with ``tmo.backend(a2a=a2a, inner="aot_eager")`` under
    ``dynamic``, on this rank's tokens of every step, against ``single`` on all of them."""
    torch._dynamo.reset()
    compiled = torch.compile(sharded, backend=tmo.backend(a2a=a2a, inner="aot_eager",
                                                          chunks=chunks),
                             fullgraph=True, dynamic=dynamic)
    world_size = dist.get_world_size()
    for step, counts in enumerate(STEPS[world_size]):
        x_NH = torch.randn(sum(counts), hidden,
                           generator=torch.Generator().manual_seed(step)).to(dtype)
        mine = token_slice(counts, rank)
        with torch.no_grad():
            expected_TH = single(x_NH)[mine]
        x_TH = x_NH[mine].clone().requires_grad_(train)
        with torch.set_grad_enabled(train):
            out_TH = compiled(x_TH)
        if train:
            out_TH.float().square().sum().backward()
            assert x_TH.grad.shape == x_TH.shape
        assert out_TH.shape == (counts[rank], hidden), (a2a, dynamic, counts)
        if dtype == torch.float32:
            torch.testing.assert_close(out_TH.detach(), expected_TH, rtol=1e-4, atol=1e-5)
        else:
            check_bf16_out(out_TH.detach(), expected_TH)


def _check_capacity(rank, world_size, a2a):
    """A layer with ``ep_capacity`` below the worst case moves rows, the one format that
    keeps it (the tokens format sizes its buffers by ``max_tokens_per_rank``): a step that
    fits matches the single process, one that overflows raises on every rank."""
    torch._dynamo.reset()
    torch.manual_seed(5)
    cfg = dict(hidden_size=H, intermediate_size=I, num_experts=2 * world_size, top_k=K,
               renormalize=True)
    single = tmo.MoE(tmo.MoEConfig(**cfg))
    sharded = tmo.MoE(tmo.MoEConfig(**cfg, ep_size=world_size, max_tokens_per_rank=M,
                                    ep_capacity=M), ep_group=dist.group.WORLD)
    sharded.load_full_weights(single.state_dict())
    (report,) = tmo.explain(sharded, torch.randn(2, H), a2a=a2a)
    assert report.plan.format.name == "rows", str(report)
    assert f"cannot keep ep_capacity={M}" in report.plan.format_reason
    compiled = torch.compile(sharded, backend=tmo.backend(a2a=a2a, inner="aot_eager"),
                             fullgraph=True)
    x_TH = torch.randn(2, H, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x_TH), single(x_TH), rtol=1e-4, atol=1e-5)
    # Every token of every rank to rank 0's experts, M tokens each: P * M rows for rank 0
    # from each peer's M * K slots, over a capacity of M.
    with torch.no_grad():
        sharded.gate.weight[2:] = -1e3 * sharded.gate.weight[:1].abs().sum()
        with pytest.raises(RuntimeError, match=f"ep_capacity is {M}; no row was dropped"):
            compiled(torch.rand(M, H) + 1)


def _torch_distributed_cases(rank, world_size):
    for a2a in ("all_to_all", "allgather"):
        _check_capacity(rank, world_size, a2a)
    single, sharded = cpu_single_and_sharded(H, I, K, M)
    for a2a in ("all_to_all", "allgather"):
        for dynamic in DYNAMIC:
            _run_steps(rank, single, sharded, H, a2a, dynamic, torch.float32, train=True)
    # Chunked transfers cut windows out of the tokens: their ops too, under every mode (on
    # 2 ranks: the windows are each rank's own).
    for dynamic in DYNAMIC if world_size == 2 else ():
        _run_steps(rank, single, sharded, H, "all_to_all", dynamic, torch.float32,
                   train=False, chunks=2)


@pytest.mark.parametrize("world_size", sorted(STEPS))
def test_torch_distributed_transports_never_hang(world_size):
    run_on_ranks(world_size, _torch_distributed_cases, timeout=TIMEOUT)


def _engine_cases(rank, world_size):
    deepep = deepep_emulator.install()
    group = dist.group.WORLD
    for mode in ("normal", "low_latency"):
        deepep.communicator(group.group_name, DEEPEP_H, 2 * world_size, K, M, torch.bfloat16,
                            mode=mode, device="cpu")
        single, sharded = cpu_single_and_sharded(DEEPEP_H, I, K, M)
        single, sharded = single.bfloat16(), sharded.bfloat16()
        for dynamic in DYNAMIC:
            _run_steps(rank, single, sharded, DEEPEP_H, "deepep", dynamic, torch.bfloat16,
                       train=False)
        deepep.close_all()
    flashinfer = flashinfer_a2a_emulator.install()
    single, sharded = cpu_single_and_sharded(H, I, K, M)
    single, sharded = single.bfloat16(), sharded.bfloat16()
    for dynamic in DYNAMIC:
        for train in (False, True):
            _run_steps(rank, single, sharded, H, "flashinfer", dynamic, torch.bfloat16, train)
    flashinfer.close_all()


@pytest.mark.triton
def test_engine_transports_never_hang(monkeypatch):
    # The FlashInfer inference ops mark received ids with a Triton kernel: the interpreter.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_on_ranks(2, _engine_cases, timeout=TIMEOUT)


# On GPUs (NCCL, Inductor, bf16): a hidden size DeepEP's low-latency kernels take, and the
# steps of 2 or 4 ranks.
GPU_A2A = ("all_to_all", "allgather", "deepep", "flashinfer")


def _gpu_reason(a2a: str, world_size: int) -> str | None:
    problem = Problem(torch.bfloat16, ep_size=world_size, hidden_size=DEEPEP_H, top_k=K,
                      num_experts=2 * world_size, num_local_experts=2, max_tokens_per_rank=M)
    return REGISTRY.a2a[a2a].why_not(BackendSpec(a2a=a2a), problem, torch.device("cuda"))


def _gpu_cases(rank, world_size, a2a):
    device = torch.device("cuda", rank)
    single, sharded = cpu_single_and_sharded(DEEPEP_H, I, K, M)
    single = single.to(device, torch.bfloat16)
    sharded = sharded.to(device, torch.bfloat16)
    for dynamic in (True, None):
        torch._dynamo.reset()
        compiled = torch.compile(sharded, backend=tmo.backend(a2a=a2a), fullgraph=True,
                                 dynamic=dynamic)
        for step, counts in enumerate(STEPS[world_size]):
            x_NH = torch.randn(sum(counts), DEEPEP_H,
                               generator=torch.Generator().manual_seed(step))
            x_NH = x_NH.to(device, torch.bfloat16)
            mine = token_slice(counts, rank)
            with torch.no_grad():
                check_bf16_out(compiled(x_NH[mine]), single(x_NH)[mine])
    torch._dynamo.reset()


@pytest.mark.multigpu
@pytest.mark.parametrize("world_size", (2, 4), ids="P{}".format)
@pytest.mark.parametrize("a2a", GPU_A2A)
def test_gpu_transports_never_hang(a2a, world_size, monkeypatch):
    """Every transport over NCCL with the cross-rank argument checks on (the setting under
    which a rank compiled for 0 or 1 tokens hung its peers)."""
    skip_without_gpus(world_size)
    reason = _gpu_reason(a2a, world_size)
    if reason is not None:
        pytest.skip(f"a2a {a2a!r}: {reason}")
    monkeypatch.setenv("TORCH_MOE_OPS_CHECK_VALUES", "1")
    run_on_ranks(world_size, _gpu_cases, a2a, backend="nccl", timeout=TIMEOUT,
                 deadline_s=400)
