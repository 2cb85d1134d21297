"""Load balancing in `MoE` (`MoEConfig.aux_loss`, ``z_loss_coeff``, ``bias_update_speed``,
``count_tokens_per_expert``) against the published formulas (`formulas`), eager and
compiled, on one process and over an expert-parallel group of two (gloo).

Legend: B sequences, S tokens per sequence, T tokens (of one rank), N tokens of all
ranks, H hidden size, E experts, K experts per token.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import re

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend

import torch_moe_ops as tmo
from distributed import run_on_ranks
from formulas import (
    route_formula,
    sequence_loss_formula,
    switch_loss_formula,
    z_loss_formula,
)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

H = 16
BALANCED = {
    "softmax_batch": tmo.MoEConfig(hidden_size=H, intermediate_size=8, num_experts=8, top_k=2,
                                   renormalize=True, aux_loss="batch", aux_loss_coeff=0.02,
                                   z_loss_coeff=1e-3),
    "sigmoid_sequence_bias": tmo.MoEConfig(
        hidden_size=H, intermediate_size=8, num_experts=8, top_k=2, scoring="sigmoid",
        renormalize=True, correction_bias=True, num_expert_groups=4, topk_groups=2,
        routed_scaling_factor=2.5, aux_loss="sequence", aux_loss_coeff=1e-3,
        z_loss_coeff=1e-3, bias_update_speed=1e-3),
    "topk_softmax_batch": tmo.MoEConfig(hidden_size=H, intermediate_size=8, num_experts=8,
                                        top_k=2, scoring="topk_softmax", router_bias=True,
                                        aux_loss="batch"),
}
TOL = {"rtol": 1e-4, "atol": 1e-7}


def _balanced_moe(name: str, **changes) -> tmo.MoE:
    """`MoE` of ``BALANCED[name]`` with ``changes``, its correction bias (if any) random."""
    torch.manual_seed(0)
    moe = tmo.MoE(dataclasses.replace(BALANCED[name], **changes))
    if moe.e_score_correction_bias is not None:
        with torch.no_grad():
            moe.e_score_correction_bias.uniform_(-0.2, 0.2)
    return moe


def _expected(moe: tmo.MoE, x_BSH: torch.Tensor, gate_weight_EH: torch.Tensor):
    """``(tokens_per_expert [E], aux_loss, z_loss)`` from the formulas, fp64, the losses
    scaled by their coefficients and differentiable in ``gate_weight``."""
    cfg = moe.cfg
    num_sequences, seq_len = x_BSH.shape[:2]
    logits_NE = x_BSH.reshape(-1, H).double() @ gate_weight_EH.T
    if moe.gate.bias is not None:
        logits_NE = logits_NE + moe.gate.bias.double()
    _, ids_NK = route_formula(logits_NE.detach(), moe.e_score_correction_bias, cfg.top_k,
                              cfg.scoring, cfg.renormalize, cfg.num_expert_groups,
                              cfg.topk_groups, cfg.routed_scaling_factor)
    counts_E = torch.stack([(ids_NK == e).sum() for e in range(cfg.num_experts)])
    if cfg.aux_loss == "sequence":
        aux = sequence_loss_formula(logits_NE.view(num_sequences, seq_len, -1),
                                    ids_NK.view(num_sequences, seq_len, -1), cfg.scoring)
    else:
        aux = switch_loss_formula(logits_NE, ids_NK, cfg.scoring)
    return counts_E, cfg.aux_loss_coeff * aux, cfg.z_loss_coeff * z_loss_formula(logits_NE)


@pytest.mark.parametrize("use_compile", [False, True])
@pytest.mark.parametrize("name", sorted(BALANCED))
def test_losses_and_counts_match_the_formulas(name, use_compile):
    moe = _balanced_moe(name)
    run = (torch.compile(moe, backend=tmo.backend(inner="aot_eager"), fullgraph=True)
           if use_compile else moe)
    x_BSH = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(1))
    run(x_BSH)
    gate_weight_EH = moe.gate.weight.detach().double().requires_grad_()
    counts_E, aux, z = _expected(moe, x_BSH, gate_weight_EH)
    assert moe.tokens_per_expert.dtype == torch.int64
    torch.testing.assert_close(moe.tokens_per_expert, counts_E)
    torch.testing.assert_close(moe.aux_loss.double(), aux, **TOL)
    expected_loss = aux
    if moe.cfg.z_loss_coeff:
        torch.testing.assert_close(moe.z_loss.double(), z, **TOL)
        expected_loss = aux + z
    else:
        assert moe.z_loss is None
    # The losses train the router: their gradient reaches gate.weight.
    tmo.router_loss(moe).backward()
    expected_grad_EH, = torch.autograd.grad(expected_loss, gate_weight_EH)
    assert expected_grad_EH.abs().max() > 0
    torch.testing.assert_close(moe.gate.weight.grad.double(), expected_grad_EH, **TOL)


@pytest.mark.parametrize("aux_loss", ["batch", "sequence"])
def test_one_compile_over_token_counts(aux_loss):
    """Every option on, compiled whole (``fullgraph=True``: a graph break raises) once for
    every marked-dynamic size, each call's values those of the eager module."""
    moe = _balanced_moe("sigmoid_sequence_bias", aux_loss=aux_loss)
    eager = copy.deepcopy(moe)
    counter = CompileCounterWithBackend(tmo.backend(inner="aot_eager"))
    compiled = torch.compile(moe, backend=counter, fullgraph=True)
    for size in (2, 3, 7):
        x = torch.randn((size, 4, H) if aux_loss == "sequence" else (size * 4, H),
                        generator=torch.Generator().manual_seed(size))
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), eager(x))
        for name in ("tokens_per_expert", "expert_load", "aux_loss", "z_loss"):
            torch.testing.assert_close(getattr(moe, name), getattr(eager, name))
    assert counter.frame_count == 1


@pytest.mark.gpu
def test_cuda_graphs_keep_counts_and_losses():
    """Compiled with ``mode="reduce-overhead"`` (CUDA graphs), trained for a few steps
    beside the eager module: the same counts, losses, router gradients and biases.
    Gradients are cleared each step (``set_to_none``, as ``optimizer.zero_grad()`` does):
    CUDA graph trees hand the backward's gradients over from their memory pool, and a
    later step's replay overwrites a gradient kept to accumulate into (PyTorch raises
    "accessing tensor output of CUDAGraphs that has been overwritten")."""
    moe = _balanced_moe("sigmoid_sequence_bias").cuda()
    eager = copy.deepcopy(moe)
    compiled = torch.compile(moe, backend=tmo.backend(mode="reduce-overhead"), fullgraph=True)
    for step in range(3):
        x_BSH = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(step)).cuda()
        torch.testing.assert_close(compiled(x_BSH), eager(x_BSH), rtol=1e-4, atol=1e-4)
        for name in ("tokens_per_expert", "expert_load"):
            torch.testing.assert_close(getattr(moe, name), getattr(eager, name))
        for name in ("aux_loss", "z_loss"):
            torch.testing.assert_close(getattr(moe, name), getattr(eager, name), **TOL)
        for block in (moe, eager):
            tmo.router_loss(block).backward()
            tmo.update_correction_biases(block)
        torch.testing.assert_close(moe.gate.weight.grad, eager.gate.weight.grad, **TOL)
        torch.testing.assert_close(moe.e_score_correction_bias, eager.e_score_correction_bias)
        for block in (moe, eager):
            block.zero_grad(set_to_none=True)


def test_reset_parameters_zeroes_the_counts():
    """Deferred initialisation (meta, ``to_empty``, ``reset_parameters``) leaves no count
    holding uninitialised memory."""
    with torch.device("meta"):
        moe = tmo.MoE(BALANCED["sigmoid_sequence_bias"])
    moe.to_empty(device="cpu")
    moe.tokens_per_expert.fill_(-1)
    moe.expert_load.fill_(-1)
    moe.reset_parameters()
    assert not moe.tokens_per_expert.any() and not moe.expert_load.any()


def test_off_traces_nothing_new():
    """Load balancing off: no buffer, no loss, and a graph without the counting; counting on
    alone adds the count and nothing else."""
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    cfg = tmo.MoEConfig(hidden_size=H, intermediate_size=8, num_experts=8, top_k=2)
    x_TH = torch.randn(6, H)
    for counting in (False, True):
        moe = tmo.MoE(dataclasses.replace(cfg, count_tokens_per_expert=counting))
        torch.compile(moe, backend=recording, fullgraph=True)(x_TH)
        assert (moe.aux_loss, moe.z_loss, moe.expert_load) == (None, None, None)
        assert [name for name, _ in moe.named_buffers()] == (["tokens_per_expert"] if counting
                                                             else [])
        assert moe.state_dict().keys() == tmo.MoE(cfg).state_dict().keys()
    off, counting = graphs
    assert "scatter_add" not in off and "copy_" not in off
    assert "scatter_add" in counting and "logsumexp" not in counting


def test_empty_input_gives_zero_losses():
    for name, x in (("softmax_batch", torch.randn(0, H)),
                    ("sigmoid_sequence_bias", torch.randn(0, 5, H))):
        moe = _balanced_moe(name)
        assert moe(x).shape == x.shape
        assert moe.tokens_per_expert.sum() == 0
        assert moe.aux_loss.item() == 0 and moe.z_loss.item() == 0


def test_a_block_with_losses_copies_and_pickles():
    """After a forward the losses hold its autograd graph; a deep copy (an EMA model) and
    ``torch.save`` of the block still work, and keep the losses' values."""
    moe = _balanced_moe("softmax_batch")
    moe(torch.randn(6, H))
    buffer = io.BytesIO()
    torch.save(moe, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(moe), torch.load(buffer, weights_only=False)):
        for name in ("aux_loss", "z_loss"):
            assert not getattr(copied, name).requires_grad
            torch.testing.assert_close(getattr(copied, name), getattr(moe, name).detach())
    # The block's own losses still carry their graph.
    assert moe.aux_loss.requires_grad and moe.z_loss.requires_grad


def test_sequence_loss_needs_sequences():
    moe = _balanced_moe("sigmoid_sequence_bias")
    with pytest.raises(ValueError, match=re.escape("x must be [..., S, H] (sequences of S "
                                                   "tokens) with aux_loss='sequence', got "
                                                   "shape (6, 16)")):
        moe(torch.randn(6, H))


def test_bias_update_moves_each_expert_towards_the_mean_load():
    moe = _balanced_moe("sigmoid_sequence_bias")
    speed = moe.cfg.bias_update_speed
    x_BSH = torch.randn(8, 8, H, generator=torch.Generator().manual_seed(2))
    start_E = moe.e_score_correction_bias.clone()
    # Two micro-batches before one step: the update sees the load of both.
    with torch.no_grad():
        moe(x_BSH[:6])
        first_E = moe.tokens_per_expert.clone()
        moe(x_BSH[6:])
    load_E = moe.expert_load.clone()
    assert torch.equal(load_E, first_E + moe.tokens_per_expert)
    tmo.update_correction_biases(moe)
    step_E = moe.e_score_correction_bias - start_E
    mean = load_E.double().mean()
    assert (step_E[load_E > mean] < 0).all() and (step_E[load_E < mean] > 0).all()
    assert (step_E[load_E == mean] == 0).all()
    torch.testing.assert_close(step_E.abs(), torch.full_like(step_E, speed) * (load_E != mean))
    assert moe.expert_load.sum() == 0


def test_bias_updates_balance_a_skewed_router():
    moe = _balanced_moe("sigmoid_sequence_bias", num_expert_groups=1, topk_groups=1,
                        aux_loss="none", bias_update_speed=0.01)
    with torch.no_grad():
        moe.gate.weight[:2] += 0.1  # two experts favoured by every token
    x_TH = torch.randn(256, H, generator=torch.Generator().manual_seed(3)).abs()

    def imbalance() -> float:
        load_E = moe.tokens_per_expert.double()
        return (load_E.max() / load_E.mean()).item()

    with torch.no_grad():
        moe(x_TH)
        before = imbalance()
        for _ in range(40):
            tmo.update_correction_biases(moe)
            moe(x_TH)
    # DeepSeek-V3's goal, and issue 35's: max / mean load below 1.2.
    assert before > 2 and imbalance() < 1.2, (before, imbalance())


def test_update_bias_without_the_update_says_so():
    with pytest.raises(ValueError, match=re.escape("update_bias needs cfg.bias_update_speed "
                                                   "> 0, got 0.0")):
        _balanced_moe("softmax_batch").update_bias()


BAD_CONFIGS = {
    "aux_loss": ({"aux_loss": "switch"},
                 "aux_loss must be one of 'none', 'batch', 'sequence', got 'switch'"),
    "negative_z": ({"z_loss_coeff": -1e-3},
                   "z_loss_coeff must be a finite float >= 0 (0 is off), got -0.001"),
    "nan_coeff": ({"aux_loss_coeff": float("nan")},
                  "aux_loss_coeff must be a finite float >= 0 (0 is off), got nan"),
    "zero_coeff": ({"aux_loss": "batch", "aux_loss_coeff": 0.0},
                   ("aux_loss_coeff must be > 0 with aux_loss='batch' (or aux_loss='none'), "
                    "got 0.0")),
    "bias_without_bias": ({"bias_update_speed": 1e-3},
                          "bias_update_speed must be 0.0 unless correction_bias=True"),
    "count_flag": ({"count_tokens_per_expert": 1},
                   "count_tokens_per_expert must be a bool, got 1"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_config_names_the_bad_field(case):
    fields, message = BAD_CONFIGS[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        tmo.MoEConfig(hidden_size=H, intermediate_size=8, num_experts=8, top_k=2, **fields)


# Expert parallelism: two ranks of 4 tokens each (equal, so that the ranks' batch losses
# average to the loss of all 8), then rank 1 idle.
EP_TOKENS = 4


def _ep_config(ep_size: int) -> tmo.MoEConfig:
    return dataclasses.replace(BALANCED["sigmoid_sequence_bias"], aux_loss="batch",
                               ep_size=ep_size,
                               max_tokens_per_rank=EP_TOKENS if ep_size > 1 else None)


def _check_expert_parallel(rank, world_size):
    torch.manual_seed(0)
    single = tmo.MoE(_ep_config(1))
    with torch.no_grad():
        single.e_score_correction_bias.uniform_(-0.2, 0.2)
    sharded = tmo.MoE(_ep_config(world_size), ep_group=dist.group.WORLD)
    sharded.load_full_weights(single.state_dict())
    x_NH = torch.randn(world_size * EP_TOKENS, H, generator=torch.Generator().manual_seed(4))
    mine = slice(rank * EP_TOKENS, (rank + 1) * EP_TOKENS)
    gate_EH = single.gate.weight.detach().double()
    counts_E, aux, _ = _expected(single, x_NH.view(1, -1, H), gate_EH)
    _, _, my_z = _expected(single, x_NH[mine].reshape(1, -1, H), gate_EH)
    compiled = torch.compile(sharded, backend=tmo.backend(a2a="all_to_all", inner="aot_eager"),
                             fullgraph=True)
    for run in (sharded, compiled):
        run(x_NH[mine])
        torch.testing.assert_close(sharded.tokens_per_expert, counts_E)
        mean_aux = sharded.aux_loss.detach().clone()
        dist.all_reduce(mean_aux)
        torch.testing.assert_close(mean_aux.double() / world_size, aux, **TOL)
        torch.testing.assert_close(sharded.z_loss.double(), my_z, **TOL)
    # Every rank saw the group's load twice and updates alike.
    assert torch.equal(sharded.expert_load, 2 * counts_E)
    bias_before = sharded.e_score_correction_bias.clone()
    tmo.update_correction_biases(sharded)
    step_E = sharded.e_score_correction_bias - bias_before
    torch.testing.assert_close(step_E, sharded.cfg.bias_update_speed
                               * torch.sign(counts_E.double().mean() - counts_E).float())
    # An idle rank joins the count's all-reduce and gets zero losses.
    sharded(x_NH[mine] if rank == 0 else x_NH[:0])
    counts_E, _, _ = _expected(single, x_NH[:EP_TOKENS].view(1, -1, H), gate_EH)
    torch.testing.assert_close(sharded.tokens_per_expert, counts_E)
    if rank == 1:
        assert sharded.aux_loss.item() == 0 and sharded.z_loss.item() == 0


def test_expert_parallel_counts_and_losses():
    run_on_ranks(2, _check_expert_parallel)
