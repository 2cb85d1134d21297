"""One plan per layer (`lowering.plan`): the format follows from what each backend's ops
define, what trains, and what the transport's engine can run for the layer's shape.

Legend: E experts, H hidden size, K experts per token, M max_tokens_per_rank.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torch_moe_ops.backends.registry import FORMATS, MASKED, REGISTRY, ROWS, TOKENS, Problem
from torch_moe_ops.config import BackendSpec, QuantSpec
from torch_moe_ops.lowering.plan import plan_layer

BF16, CPU = torch.bfloat16, torch.device("cpu")


def _problem(**fields) -> Problem:
    layer = dict(num_experts=64, num_local_experts=32, hidden_size=2048, top_k=8, ep_size=2,
                 max_tokens_per_rank=64, training=False)
    layer.update(fields)
    if "ep_size" in fields:
        layer["num_local_experts"] = layer["num_experts"] // layer["ep_size"]
    return Problem(BF16, **layer)


@pytest.fixture
def deepep_runs_here(monkeypatch):
    """DeepEP's shape rules as they are, without DeepEP or a GPU."""
    deepep = REGISTRY.a2a["deepep"]
    monkeypatch.setitem(REGISTRY.a2a, "deepep",
                        dataclasses.replace(deepep, supports=lambda *_: None))


@pytest.fixture
def flashinfer_runs_here(monkeypatch):
    """FlashInfer's a2a planned as where it runs, without FlashInfer or a GPU."""
    flashinfer = REGISTRY.a2a["flashinfer"]
    monkeypatch.setitem(REGISTRY.a2a, "flashinfer",
                        dataclasses.replace(flashinfer, supports=lambda *_: None))


@pytest.mark.parametrize("fields, fmt, why", [
    # Decode sizes: DeepEP's low-latency blocks, read where they arrive.
    ({}, "masked", "decode layout, read where it arrives"),
    ({"max_tokens_per_rank": 512}, "tokens", ("the masked format runs low-latency mode: "
                                             "DeepEP's low-latency mode serves decode batches")),
    ({"training": True}, "rows", ("deepep carries no gradient in masked; deepep carries no "
                                 "gradient in tokens")),
    # fp8 blocks of 128 columns per scale travel through DeepEP's own low-latency cast;
    # fp8_token blocks cannot: rows, quantized on arrival.
    ({"quant": QuantSpec("fp8_block")}, "masked", "quantized layer: the transport's decode"),
    ({"quant": QuantSpec("fp8_channel")}, "rows",
     ("deepep cannot move this layer in masked: its fp8 blocks travel through DeepEP's "
     "low-latency cast only")),
    ({"quant": QuantSpec("fp8_block"), "max_tokens_per_rank": 512}, "rows",
     "rows travel in fp8 with their scales, tokens in the activations' dtype"),
    # Normal mode runs 2, 4 or 8 ranks of one host; low-latency mode 3 too.
    ({"ep_size": 3, "num_experts": 63}, "masked", "read where it arrives"),
], ids=["decode", "prefill", "training", "quantized", "quantized_per_token",
        "quantized_prefill", "three_ranks"])
def test_deepep_layers_take_the_format_its_engine_runs(deepep_runs_here, fields, fmt, why):
    plan = plan_layer(BackendSpec(a2a="deepep", experts="reference"), _problem(**fields), CPU)
    assert plan.format.name == fmt and why in plan.format_reason, plan


def test_experts_that_do_not_read_masked_blocks_take_tokens_and_say_so(deepep_runs_here):
    plan = plan_layer(BackendSpec(a2a="deepep", experts="cpu"), _problem(), CPU)
    assert plan.format.name == "tokens" and plan.format_reason == "cpu does not read masked", plan


@pytest.mark.parametrize("a2a", ["all_to_all", "allgather"])
@pytest.mark.parametrize("training", [False, True])
def test_torch_distributed_layers_take_tokens_training_or_not(a2a, training):
    plan = plan_layer(BackendSpec(a2a=a2a, experts="reference"), _problem(training=training),
                      CPU)
    assert (plan.a2a.name, plan.format.name, plan.experts.name) == (a2a, "tokens", "reference")


def test_the_auto_candidates_refused_are_listed_with_their_reasons():
    plan = plan_layer(BackendSpec(a2a="allgather"), _problem(), CPU)
    refused = {name: reason for kind, name, reason in plan.refused if kind == "experts"}
    assert plan.experts.name not in refused and "triton" in refused and refused["triton"]


def test_one_device_layers_have_no_format():
    plan = plan_layer(BackendSpec(), Problem(BF16, num_local_experts=8, hidden_size=64,
                                             top_k=2), CPU)
    assert plan.format is None and plan.a2a.name == "none"


def test_deepep_serves_layers_its_normal_mode_cannot_run_in_rows():
    from torch_moe_ops.backends.deepep.supports import shape_reason

    three_ranks = _problem(ep_size=3, num_experts=63)
    assert shape_reason(three_ranks) is None
    assert "normal mode" in shape_reason(dataclasses.replace(three_ranks, top_k=64))


def test_the_names_a_spec_accepts_are_the_registered_backends():
    # BackendSpec validates at construction (config.py, below the backends): its lists of
    # names must be the registry's, plus "auto".
    from torch_moe_ops.config import A2A_BACKEND_NAMES, EXPERTS_BACKEND_NAMES, ROUTE_BACKEND_NAMES

    assert set(EXPERTS_BACKEND_NAMES) == {"auto", *REGISTRY.experts}
    assert set(A2A_BACKEND_NAMES) == set(REGISTRY.a2a)
    assert set(ROUTE_BACKEND_NAMES) == {"auto", *REGISTRY.route}


@pytest.mark.parametrize("a2a", ["all_to_all", "allgather"])
@pytest.mark.parametrize("fields, asked, chunks, why", [
    ({"max_tokens_per_rank": 4096}, None, 1, "none asked: each chunk reads every local"),
    ({"max_tokens_per_rank": 4096}, 1, 1, "chunks=1 asked"),
    ({"max_tokens_per_rank": 64}, 3, 3, "chunks=3 asked"),
    ({"max_tokens_per_rank": 2}, 3, 2, "at most max_tokens_per_rank (2)"),
    ({"max_tokens_per_rank": 4096, "training": True}, 2, 1, "training"),
    ({"max_tokens_per_rank": 4096, "quant": QuantSpec("fp8_channel")}, 2, 1,
     "the rows format moves whole"),
], ids=["none_asked", "off", "asked", "clamped", "training", "rows"])
def test_layers_move_in_the_chunks_asked_where_the_transport_overlaps(a2a, fields, asked,
                                                                      chunks, why):
    plan = plan_layer(BackendSpec(a2a=a2a, experts="reference", chunks=asked),
                      _problem(**fields), CPU)
    assert plan.chunks == chunks and why in plan.chunks_reason, plan


@pytest.mark.parametrize("fields, a2a, overlap, in_flight, why", [
    ({"max_tokens_per_rank": 4096}, "all_to_all", True, True, "runs while they travel"),
    ({"max_tokens_per_rank": 1024}, "allgather", True, True, "runs while they travel"),
    ({"max_tokens_per_rank": 4096}, "all_to_all", False, False, "overlap=False: not yet shown"),
    ({"max_tokens_per_rank": 128}, "all_to_all", True, False, "a decode transfer is latency"),
    ({"max_tokens_per_rank": 4096, "training": True}, "all_to_all", True, False, "training"),
    ({"max_tokens_per_rank": 4096}, "deepep", True, True, "runs while they travel"),
    ({"max_tokens_per_rank": 4096}, "flashinfer", True, False, "issues and waits each transfer"),
], ids=["prefill", "allgather", "not_asked", "decode", "training", "deepep", "flashinfer"])
def test_prefill_transfers_stay_in_flight_under_independent_work(
        deepep_runs_here, flashinfer_runs_here, fields, a2a, overlap, in_flight, why):
    plan = plan_layer(BackendSpec(a2a=a2a, experts="reference", overlap=overlap),
                      _problem(**fields), CPU)
    assert plan.in_flight == in_flight and why in plan.in_flight_reason, plan


def test_transports_that_wait_inside_their_ops_move_whole(deepep_runs_here,
                                                          flashinfer_runs_here):
    plan = plan_layer(BackendSpec(a2a="flashinfer", experts="reference", chunks=4),
                      _problem(max_tokens_per_rank=4096), CPU)
    assert plan.chunks == 1 and "flashinfer issues and waits" in plan.chunks_reason, plan
    # DeepEP's normal mode moves the tokens format in flight (`backends.deepep.in_flight`).
    plan = plan_layer(BackendSpec(a2a="deepep", experts="reference", chunks=4),
                      _problem(max_tokens_per_rank=4096), CPU)
    assert plan.chunks == 4 and plan.format.name == "tokens", plan


@pytest.mark.parametrize("chunks", [0, -2, 1.5, True])
def test_a_chunk_count_must_be_a_positive_int(chunks):
    with pytest.raises(ValueError, match="chunks"):
        BackendSpec(a2a="all_to_all", chunks=chunks)


def test_deepep_refuses_normal_mode_over_hosts(deepep_runs_here):
    # 16 ranks: hosts of 8 GPUs. Normal mode's static receive size is intranode-only in
    # DeepEP; a decode layer still runs on low-latency mode over hosts.
    prefill = _problem(ep_size=16, num_experts=256, max_tokens_per_rank=4096)
    with pytest.raises(ValueError, match="num_worst_tokens, is intranode-only"):
        plan_layer(BackendSpec(a2a="deepep", experts="reference"), prefill, CPU)
    decode = plan_layer(BackendSpec(a2a="deepep", experts="reference"),
                        dataclasses.replace(prefill, max_tokens_per_rank=64), CPU)
    assert decode.format.name == "masked", decode


@pytest.mark.parametrize("fields, mode, namespace, why", [
    ({}, "low_latency", "moe_deepep", "the masked format is its own layout"),
    ({"max_tokens_per_rank": 512}, "normal", "moe_deepep",
     "the tokens format runs normal mode; its kernels on 48 SMs (deepep.set_num_sms)"),
    ({"training": True}, "low_latency", "moe_deepep_low_latency", "64) <= 128: a decode size"),
    ({"training": True, "max_tokens_per_rank": 512}, "normal", "moe_deepep",
     "max_tokens_per_rank (512) is not a decode size"),
    ({"training": True, "max_tokens_per_rank": 512}, "normal", "moe_deepep", "on 48 SMs"),
    # 2 * 7 positions: not a multiple of 4, which low-latency mode needs.
    ({"training": True, "max_tokens_per_rank": 7}, "normal", "moe_deepep",
     "low-latency mode cannot run it: DeepEP's low-latency kernels need ep_size"),
], ids=["masked", "tokens", "decode_rows", "prefill_rows", "prefill_rows_sms",
        "rows_low_latency_cannot_run"])
def test_the_plan_fixes_deepeps_mode_and_the_namespace_that_runs_it(deepep_runs_here, fields,
                                                                    mode, namespace, why):
    plan = plan_layer(BackendSpec(a2a="deepep", experts="reference"), _problem(**fields), CPU)
    assert (plan.mode.name, plan.mode.namespace) == (mode, namespace) and why in plan.mode.reason
    # Every transport op of the layer runs in the mode's namespace: the op names the mode.
    assert {plan.namespace_for(op) for op in plan.format.a2a_ops} == {namespace}


def test_transports_of_one_mode_have_none_in_their_plan():
    plan = plan_layer(BackendSpec(a2a="all_to_all", experts="reference"), _problem(), CPU)
    assert plan.mode is None and plan.namespace_for("dispatch_tokens") == "moe_all_to_all"


def test_a_format_names_the_ops_that_move_and_read_it():
    assert [fmt.name for fmt in FORMATS] == ["masked", "tokens", "rows"]
    assert (TOKENS.transport_ops, TOKENS.experts_op(False), TOKENS.experts_op(True)) == (
        ("dispatch_tokens", "combine_tokens"), "experts", "experts_quant")
    assert MASKED.a2a_ops == ("dispatch_masked", "combine_masked", "dispatch_masked_quant")
    assert ROWS.a2a_ops == ("dispatch", "combine", "dispatch_backward", "combine_backward",
                            "dispatch_quant")
    assert str(ROWS) == "rows" and not MASKED.training
    with pytest.raises(dataclasses.FrozenInstanceError):
        ROWS.dispatch = "dispatch_tokens"
