"""`torch_moe_ops.parallel.save_full_checkpoint`: a patched transformers model trained with
FSDP2 and expert parallelism on a 2-D mesh ``(dp_shard, ep)`` (2 x 2 and 1 x 4, four
gloo ranks), written from all ranks as one transformers checkpoint, loads with
``from_pretrained`` into an unsharded, unpatched model: its weights are the sharded
model's, gathered, bit for bit, and they and its logits match one process's unpatched
model trained on the whole batch.

Legend: B batch (sequences), S sequence length, V vocabulary.

One process launch runs every case (`distributed.run_on_ranks`, bounded in time; the
mesh's sub-groups get the same timeout as the world's).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from distributed import device_mesh, run_on_ranks
from test_fsdp_ep import _skip_before_torch_2_13

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors import safe_open

from test_hf import FP32_TOL, make_model
from torch_moe_ops import hf
from torch_moe_ops.parallel import (
    MESH_DIMS,
    full_state_dict,
    parallelize_moe,
    save_full_checkpoint,
)

WORLD_SIZE = 4
BATCH, SEQ, VOCAB = 4, 8, 128
LR = 0.1
STEPS = 2
# (mesh shape, family): both small random-weight models of test_hf, 8 experts each.
CASES = (((2, 2), "qwen3_moe"), ((1, 4), "olmoe"))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of ``step``, the same on every rank: ids and targets [B, S]."""
    generator = torch.Generator().manual_seed(step)
    ids_BS = torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)
    targets_BS = torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)
    return ids_BS, targets_BS


def _train(model, rows: slice) -> None:
    """``STEPS`` SGD steps on ``rows`` of each batch, the loss the mean over them."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        ids_BS, targets_BS = _batch(step)
        optimizer.zero_grad()
        logits_BSV = model(ids_BS[rows]).logits
        F.cross_entropy(logits_BSV.flatten(0, 1), targets_BS[rows].flatten()).backward()
        optimizer.step()


def _sharded_model(family: str, shape: tuple[int, int]):
    """``family``'s tiny model (test_hf's weights), patched with expert parallelism over
    ``mesh["ep"]``, then parallelized on the mesh."""
    mesh = device_mesh("cpu", shape, MESH_DIMS)
    model = make_model(family)
    report = hf.patch(model, ep_group=mesh["ep"], max_tokens_per_rank=BATCH // WORLD_SIZE * SEQ)
    assert report.blocks and not report.skipped, report
    return parallelize_moe(model, mesh)


def _check_export(rank: int, family: str, shape: tuple[int, int], folder: str) -> None:
    label = f"{family} {shape[0]}x{shape[1]}"
    model = _sharded_model(family, shape)
    per_rank = BATCH // WORLD_SIZE
    _train(model, slice(rank * per_rank, (rank + 1) * per_rank))
    gathered = full_state_dict(model)
    save_full_checkpoint(model, folder)
    if rank != 0:
        return
    single = make_model(family)
    _train(single, slice(None))
    with safe_open(Path(folder) / "model.safetensors", "pt") as written:
        written_keys = set(written.keys())
    # transformers' stored format: one tensor per expert and projection.
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in written_keys, label
    exported = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    expected = single.state_dict()
    exported_state = exported.state_dict()
    assert exported_state.keys() == expected.keys(), label
    for key, value in exported_state.items():
        assert torch.equal(value, gathered[key]), f"{label} {key}: not the sharded weights"
        torch.testing.assert_close(value, expected[key], **FP32_TOL,
                                   msg=lambda m, k=key: f"{label} {k}: {m}")
    ids_BS, _ = _batch(STEPS)
    with torch.no_grad():
        torch.testing.assert_close(exported(ids_BS).logits, single(ids_BS).logits, **FP32_TOL,
                                   msg=lambda m: f"{label} logits: {m}")


def _run_cases(rank, world_size, folder):
    for shape, family in CASES:
        _check_export(rank, family, shape, f"{folder}/{family}")


def test_sharded_patched_model_exports_transformers_checkpoint(tmp_path):
    _skip_before_torch_2_13()
    run_on_ranks(WORLD_SIZE, _run_cases, str(tmp_path))
