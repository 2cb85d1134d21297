"""FSDP2 (`fully_shard`) on a model with MoE layers: two ranks, each with half of
the batch, train as one process does with the whole model on the whole batch.
Every step's loss, the gradients and the parameters after SGD steps (gathered
with ``full_tensor()``) equal the single process's, eagerly and with each block
compiled before it is sharded (torchtitan's order).

Legend: B batch (sequences), S sequence length, V vocabulary.

FSDP2 all-gathers a block's parameters before its forward and hands the modules
plain tensors: the MoE ops never see a DTensor. Each test starts its ranks once
(`distributed.run_on_ranks`, bounded in time) and runs every case in them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

import torch_moe_ops as tmo
from distributed import run_on_ranks
from graph_tests.toy_model import CONFIGS, make_model

WORLD_SIZE = 2
MODEL_NAMES = sorted(CONFIGS)
BATCH, SEQ, VOCAB = 4, 8, 64
LR = 0.1
# The second step runs on the parameters the first step updated, shard by shard.
STEPS = 2
# The ranks multiply half the rows the single process does: the same sums in
# another blocking, and gradients averaged over the ranks.
TOLERANCES = {"cpu": {"rtol": 1e-5, "atol": 1e-6}, "cuda": {"rtol": 1e-4, "atol": 1e-5}}


def _batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of ``step``, the same on every rank: ids and targets [B, S]."""
    generator = torch.Generator().manual_seed(step)
    ids_BS = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    targets_BS = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return ids_BS.to(device), targets_BS.to(device)


def _loss(model, ids_BS: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids_BS).flatten(0, 1), targets_BS.flatten())


def _shard(model, mesh, backend) -> CompileCounterWithBackend | None:
    """Shards every block, then the rest; with a ``backend``, compiles each block
    first (the FSDP hooks stay outside the compiled region). Returns the counter
    of the compiled graphs, if any."""
    counter = None if backend is None else CompileCounterWithBackend(backend)
    for index, block in enumerate(model.blocks):
        if counter is not None:
            block = model.blocks[index] = torch.compile(block, backend=counter, fullgraph=True)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return counter


def _check_expert_weights_sharded(model, world_size: int) -> None:
    """FSDP2 holds each expert weight as a DTensor, this rank's experts local."""
    w13 = [p for name, p in model.named_parameters() if name.endswith("moe.w13")]
    assert len(w13) == len(model.blocks)
    for param in w13:
        assert isinstance(param, DTensor) and param.placements == (Shard(0),)
        assert param.to_local().shape[0] == param.shape[0] // world_size


def assert_trains_like(model, single, rank: int, world_size: int, device: torch.device,
                       label: str) -> None:
    """``STEPS`` SGD steps of the sharded ``model`` on this rank's equal share of each batch
    against ``single`` on the whole batch: every step's loss, the last step's gradients
    and the parameters after the steps (gathered with ``full_tensor()``). ``label`` names
    the case in a failure."""
    tolerance = TOLERANCES[device.type]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    single_optimizer = torch.optim.SGD(single.parameters(), lr=LR)
    per_rank = BATCH // world_size
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    for step in range(STEPS):
        ids_BS, targets_BS = _batch(step, device)
        optimizer.zero_grad()
        single_optimizer.zero_grad()
        loss = _loss(model, ids_BS[mine], targets_BS[mine])
        loss.backward()
        single_loss = _loss(single, ids_BS, targets_BS)
        single_loss.backward()
        # Each rank's loss is the mean over its share of the batch, and FSDP averages
        # the gradients over the ranks: the mean of equal shares' means is the
        # whole batch's mean, the single process's loss.
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        torch.testing.assert_close(mean_loss / world_size, single_loss.detach(), **tolerance,
                                   msg=lambda m, s=step: f"{label} step {s} loss: {m}")
        if step == STEPS - 1:
            for (param_name, param), expected in zip(model.named_parameters(),
                                                     single.parameters(), strict=True):
                torch.testing.assert_close(
                    param.grad.full_tensor(), expected.grad, **tolerance,
                    msg=lambda m, n=param_name: f"{label} {n}.grad: {m}")
        optimizer.step()
        single_optimizer.step()
    for (param_name, param), expected in zip(model.named_parameters(), single.parameters(),
                                             strict=True):
        torch.testing.assert_close(param.full_tensor().detach(), expected.detach(), **tolerance,
                                   msg=lambda m, n=param_name: f"{label} {n}: {m}")


def _check_training(rank, world_size, name, device, backend) -> None:
    torch._dynamo.reset()
    single = make_model(name, device=device)
    model = make_model(name, device=device)  # the same seed: the same weights
    counter = _shard(model, init_device_mesh(device.type, (world_size,)), backend)
    _check_expert_weights_sharded(model, world_size)
    assert_trains_like(model, single, rank, world_size, device, name)
    if counter is not None:
        assert counter.frame_count > 0


def _run_cases(rank, world_size, device_type, inner) -> None:
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    for name in MODEL_NAMES:
        for backend in (None, tmo.backend(inner=inner)):
            _check_training(rank, world_size, name, device, backend)


def test_fsdp2_matches_single_process_on_cpu():
    # Gloo runs FSDP2's all-gather and reduce-scatter; aot_eager keeps compiling fast.
    run_on_ranks(WORLD_SIZE, _run_cases, "cpu", "aot_eager")


@pytest.mark.multigpu
def test_fsdp2_matches_single_process_on_gpus():
    run_on_ranks(WORLD_SIZE, _run_cases, "cuda", "inductor", backend="nccl")
