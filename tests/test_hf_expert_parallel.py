"""`torch_moe_ops.hf.patch(model, ep_group=...)` on CPU processes (gloo): each rank
holds only its slice of the experts, and its logits (and gradients) equal the
unpatched model's on its own tokens.

Legend: P ranks, B batch, S sequence, E experts, E_l = E / P, V vocabulary.

Every rank builds the same tiny random model (same seed), feeds its own tokens
(different batch and sequence sizes on each rank), and compares against the
unpatched model on the same tokens. Each test starts P processes once and runs
its cases in them; `distributed.run_on_ranks` bounds every collective and the
whole run.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from distributed import run_on_ranks

transformers = pytest.importorskip("transformers")

import torch_moe_ops as tmo
from test_hf import FP32_TOL, make_model
from torch_moe_ops import hf

VOCAB = 64
# (batch, sequence) of each rank: different sizes, one rank with a single token.
SHAPES = {2: ((2, 7), (1, 1)), 3: ((2, 7), (1, 1), (1, 5))}
MAX_TOKENS = 14
EP_SIZES = {"qwen3_moe": dict(num_experts=6, num_experts_per_tok=2),
            "deepseek_v3": dict(n_routed_experts=12),
            "gpt_oss": dict(num_local_experts=6)}


def _model(family: str) -> torch.nn.Module:
    # test_hf's tiny model, with expert counts that divide over 2 and 3 ranks.
    return make_model(family, vocab_size=VOCAB, **EP_SIZES[family])


def _ids(rank: int, world_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randint(3, VOCAB, SHAPES[world_size][rank],
                         generator=generator)  # [B, S]


def _experts_modules(model) -> dict[str, torch.nn.Module]:
    return {name: module.experts for name, module in model.named_modules()
            if hf.family_of(module) is not None or isinstance(module, hf.HFMoEBlock)}


def _patch(model, **kwargs):
    return hf.patch(model, ep_group=dist.group.WORLD, max_tokens_per_rank=MAX_TOKENS, **kwargs)


def _check_slices(model, full, local: range) -> int:
    """Each expert parameter holds experts ``local`` of the full one (read through the
    state dict, which gives GPT-OSS's experts in transformers' layout); returns how
    many elements the patch dropped."""
    dropped = 0
    state = model.state_dict()
    for name, experts in _experts_modules(model).items():
        assert all(isinstance(p, torch.nn.Parameter) and p.shape[0] == len(local)
                   for p in experts.parameters())
        for key, full_tensor in full[name].items():
            mine = state[f"{name}.experts.{key}"]
            torch.testing.assert_close(mine, full_tensor[local.start:local.stop], rtol=0, atol=0)
            dropped += full_tensor.numel() - mine.numel()
    return dropped


def _check_family(rank, world_size, family):
    """Logits equal the unpatched model's; only this rank's experts stay, the rest are freed;
    a full state dict loads into the sharded model."""
    model = _model(family)
    ids = _ids(rank, world_size)
    full_state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    # Every parameter of an experts module is an expert tensor [E, ...].
    full = {name: dict(experts.named_parameters())
            for name, experts in _experts_modules(model).items()}
    freed = [weakref.ref(tensor) for tensors in full.values() for tensor in tensors.values()]
    numel_before = sum(p.numel() for p in model.parameters())

    report = _patch(model)
    (num_experts,) = {tensor.shape[0] for tensors in full.values() for tensor in tensors.values()}
    num_local = num_experts // world_size
    local = range(rank * num_local, (rank + 1) * num_local)
    assert report.patched == sorted(full) and report.skipped == {}
    assert all(block.local_experts == local for block in report.blocks)
    assert f"this rank holds experts {local.start}..{local.stop - 1}" in str(report)
    with torch.no_grad():
        got = model(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, **FP32_TOL)

    # Each rank holds E_l experts: its slice, in a new tensor; the full ones are freed.
    dropped = _check_slices(model, full, local)
    del full
    gc.collect()
    assert all(ref() is None for ref in freed)
    assert numel_before - sum(p.numel() for p in model.parameters()) == dropped > 0

    # The same full checkpoint loads on every rank; the state dict keeps its keys.
    assert list(model.state_dict()) == list(full_state)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    model.load_state_dict(full_state)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits, want, **FP32_TOL)


def _check_gradients(rank, world_size):
    """Training through the sharded blocks: every gradient equals the unpatched model's,
    an expert's summed over the ranks whose tokens reached it."""
    model = _model("qwen3_moe").train()
    ids = _ids(rank, world_size)
    reference = copy.deepcopy(model)
    reference(ids, labels=ids, use_cache=False).loss.backward()
    _patch(model)
    model(ids, labels=ids, use_cache=False).loss.backward()
    want = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        want_grad = want[name].grad
        if param.shape != want[name].shape:  # an expert tensor: this rank's slice
            want_grad = want_grad.clone()
            dist.all_reduce(want_grad)
            num_local = param.shape[0]
            want_grad = want_grad[rank * num_local:(rank + 1) * num_local]
        torch.testing.assert_close(param.grad, want_grad, rtol=1e-4, atol=1e-5, msg=name)


def _check_compiled(rank, world_size, a2a):
    model = _model("qwen3_moe")
    ids = _ids(rank, world_size)
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        _patch(model)
        compiled = torch.compile(model, backend=tmo.backend(a2a=a2a, inner="aot_eager"),
                                 fullgraph=True)
        torch.testing.assert_close(compiled(ids, use_cache=False).logits, want, **FP32_TOL)


def _check_bad_input(rank, world_size):
    model = _model("qwen3_moe")
    with pytest.raises(ValueError, match="max_tokens_per_rank must be a positive int"):
        hf.patch(model, ep_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="max_tokens_per_rank must be None without ep_group"):
        hf.patch(model, max_tokens_per_rank=MAX_TOKENS)
    assert not any(isinstance(m, hf.HFMoEBlock) for m in model.modules())
    _patch(model)
    # Every rank passes too many tokens: each raises before any collective.
    with pytest.raises(ValueError, match="max_tokens_per_rank"), torch.no_grad():
        model(torch.full((1, MAX_TOKENS + 1), 5))


def _all_cases(rank, world_size):
    for family in ("qwen3_moe", "deepseek_v3", "gpt_oss"):
        _check_family(rank, world_size, family)
    _check_gradients(rank, world_size)
    for a2a in ("all_to_all", "allgather"):
        _check_compiled(rank, world_size, a2a)
    _check_bad_input(rank, world_size)


def _three_rank_cases(rank, world_size):
    # Process start-up is most of a run's cost: the families and backends are covered
    # on two ranks, here the canonical layout with an odd number of ranks.
    _check_family(rank, world_size, "qwen3_moe")
    _check_gradients(rank, world_size)


def test_two_ranks_match_unpatched():
    run_on_ranks(2, _all_cases)


def test_three_ranks_match_unpatched():
    run_on_ranks(3, _three_rank_cases)
