"""FSDP2 with expert parallelism on a 2-D mesh ``(dp_shard, ep)``
(`torch_moe_ops.parallel.parallelize_moe`): four ranks, each with a quarter of the
batch, train as one process does with the whole model on the whole batch (every
step's loss, the gradients and the parameters after SGD steps), on meshes 2 x 2,
1 x 4 and 4 x 1, eagerly and with each block compiled, with activation checkpointing
(compiled blocks too, with and without expert parallelism);
and a ``torch.distributed.checkpoint`` saved on 2 x 2 loads on 1 x 4 and into
one process's unsharded model, bit for bit.

Legend: B batch (sequences), S sequence length.

One process launch runs every case (`distributed.run_on_ranks`, bounded in time; the
mesh's sub-groups get the same timeout as the world's).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

import torch_moe_ops as tmo
from distributed import device_mesh, run_on_ranks, skip_without_gpus
from graph_tests.toy_model import CONFIGS, ToyMoEModel, make_model
from test_fsdp import BATCH, SEQ, assert_trains_like
from torch_moe_ops.parallel import MESH_DIMS, parallelize_moe

WORLD_SIZE = 4
# (mesh shape, model, compiled, activation checkpointing): the model with shared
# experts and a correction bias, and the one with expert and router biases.
CASES = (((2, 2), "deepseek", False, False), ((2, 2), "deepseek", True, False),
         ((2, 2), "gpt_oss", False, True), ((1, 4), "gpt_oss", True, True),
         ((4, 1), "deepseek", True, True))
# The model that trained on 2 x 2 is the one saved.
SAVED_CASE = CASES[0]


def _sharded_model(name: str, shape: tuple[int, int], device: torch.device, inner, checkpoint,
                   seed: int = 0):
    """The toy model of ``name`` on a mesh of ``shape``, built with the experts of
    ``make_model(name, seed=seed)``, then parallelized."""
    mesh = device_mesh(device.type, shape, MESH_DIMS)
    ep_size = shape[1]
    max_tokens = BATCH // WORLD_SIZE * SEQ if ep_size > 1 else None
    cfg = dataclasses.replace(CONFIGS[name], ep_size=ep_size, max_tokens_per_rank=max_tokens)
    model = ToyMoEModel(cfg, device=device, ep_group=mesh["ep"])
    model.load_state_dict(make_model(name, device=device, seed=seed).state_dict())
    a2a = {"a2a": "all_to_all"} if ep_size > 1 else {}
    backend = None if inner is None else tmo.backend(inner=inner, **a2a)
    return parallelize_moe(model, mesh, activation_checkpoint=checkpoint,
                           compile_backend=backend)


def _check_training(rank, world_size, shape, name, device, inner, checkpoint):
    torch._dynamo.reset()
    single = make_model(name, device=device)
    model = _sharded_model(name, shape, device, inner, checkpoint)
    # Every gradient is averaged over the four ranks, the experts' too, though FSDP
    # reduces them over dp_shard only.
    assert_trains_like(model, single, rank, world_size, device,
                       f"{name} {shape[0]}x{shape[1]} {'compiled' if inner else 'eager'}")
    return model


def _full_state(model) -> dict[str, torch.Tensor]:
    return {name: value.full_tensor() if isinstance(value, DTensor) else value
            for name, value in get_model_state_dict(model).items()}


def _check_checkpoint(rank, saved_model, name, device, path) -> None:
    """``saved_model`` (2 x 2, trained) saved with DCP, loaded into a 1 x 4 model of other
    weights, and on rank 0 into an unsharded model in one process: bitwise equal."""
    saved = _full_state(saved_model)
    dcp.save(get_model_state_dict(saved_model), checkpoint_id=path)
    model = _sharded_model(name, (1, 4), device, None, False, seed=1)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state)
    for key, value in _full_state(model).items():
        assert torch.equal(value, saved[key]), f"1x4 {key}"
    if rank == 0:
        single = make_model(name, device=device, seed=1)
        state = single.state_dict()
        dcp.load(state, checkpoint_id=path, no_dist=True)
        for key, value in state.items():
            assert torch.equal(value, saved[key]), f"one process {key}"


def _run_cases(rank, world_size, device_type, inner, path):
    device = (torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda"
              else torch.device("cpu"))
    for case in CASES:
        shape, name, compiled, checkpoint = case
        model = _check_training(rank, world_size, shape, name, device,
                                inner if compiled else None, checkpoint)
        if case == SAVED_CASE:
            _check_checkpoint(rank, model, name, device, path)


def _skip_before_torch_2_13() -> None:
    """parallelize_moe shards the experts over another mesh than their FSDP group's,
    which FSDP2 does from torch 2.13 on (torch_compat.fsdp_shard_placement)."""
    common = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_common")
    if not hasattr(common, "ShardPlacementResult"):
        pytest.skip(f"parallelize_moe needs torch >= 2.13, got {torch.__version__}")


def test_fsdp2_with_expert_parallelism_on_cpu(tmp_path):
    _skip_before_torch_2_13()
    # Gloo runs FSDP2's collectives and the experts' all-to-all; aot_eager compiles fast.
    run_on_ranks(WORLD_SIZE, _run_cases, "cpu", "aot_eager", str(tmp_path))


@pytest.mark.multigpu
def test_fsdp2_with_expert_parallelism_on_gpus(tmp_path):
    skip_without_gpus(WORLD_SIZE)
    _skip_before_torch_2_13()
    run_on_ranks(WORLD_SIZE, _run_cases, "cuda", "inductor", str(tmp_path), backend="nccl")
