"""`torch_moe_ops.hf`: patched transformers models compute what the originals do.

Legend: B batch, S sequence, T tokens (B * S), H hidden size, K experts per token,
V vocabulary.

Tiny random models of every family, built from transformers' config classes with
transformers' own initialization (a larger ``initializer_range`` so routing and
experts visibly move the logits: a wrong renormalization shifts them by ~1).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

import torch_moe_ops as tmo
from torch_moe_ops import hf
from torch_moe_ops.lowering import moe_op_sequence

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

COMMON = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


# family -> (config class, its sizes): tiny models of every family.
CONFIGS = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=48, num_local_experts=8,
                                      num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=64, moe_intermediate_size=24,
                                         shared_expert_intermediate_size=40, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=64, moe_intermediate_size=24,
                                         num_experts=8, num_experts_per_tok=3,
                                         norm_topk_prob=True, head_dim=8)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                                  norm_topk_prob=False)),
    # Layer 0 stays dense (first_k_dense_replace=1): the patch must leave it alone.
    "deepseek_v3": ("DeepseekV3Config", dict(
        num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=16,
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=24, num_local_experts=8,
                                     num_experts_per_tok=2, head_dim=8, sliding_window=8)),
}


def _config(family: str, **overrides):
    """``family``'s tiny config; ``overrides`` replace or add fields."""
    class_name, sizes = CONFIGS[family]
    return getattr(transformers, class_name)(**{**COMMON, **sizes, **overrides})


# family -> (MoE blocks, expert tensors used in place, expert tensors converted)
EXPECTED = {
    "mixtral": (2, 4, 0),
    "qwen2_moe": (2, 4, 0),
    "qwen3_moe": (2, 4, 0),
    "olmoe": (2, 4, 0),
    "deepseek_v3": (1, 2, 0),
    "gpt_oss": (2, 2, 6),  # down_proj_bias shared; gate_up_proj(+bias), down_proj converted
}
FAMILIES = sorted(EXPECTED)
CANONICAL = [family for family in FAMILIES if family != "gpt_oss"]
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}


def make_model(family: str, dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    config = _config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            # transformers initializes it to zeros; make it steer the selection.
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.1, 0.1)
    return model.to(dtype)


def token_ids(batch: int = 2, seq: int = 7, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, COMMON["vocab_size"], (batch, seq), generator=generator)  # [B, S]


class OpLog(TorchDispatchMode):
    """Names of the ops that run under it."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def _moe_blocks(model) -> dict[str, torch.nn.Module]:
    return {name: module for name, module in model.named_modules()
            if isinstance(module, hf.HFMoEBlock)}


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_matches_original(family):
    model = make_model(family)
    ids = token_ids()
    keys = list(model.state_dict())
    with torch.no_grad():
        # Before patching: also installs transformers' output hooks on the routers.
        want = model(ids, labels=ids, output_router_logits=True)
        hf.patch(model)
        with OpLog() as log:
            got = model(ids, labels=ids, output_router_logits=True)
    torch.testing.assert_close(got.logits, want.logits, **FP32_TOL)
    torch.testing.assert_close(got.loss, want.loss, **FP32_TOL)
    if want.get("router_logits") is None:  # DeepSeek-V3 before transformers 5.18
        assert got.get("router_logits") is None
    else:
        assert len(got.router_logits) == len(want.router_logits) == EXPECTED[family][0]
        for got_TE, want_TE in zip(got.router_logits, want.router_logits):
            torch.testing.assert_close(got_TE, want_TE, **FP32_TOL)
        # The load-balancing loss is computed from the recorded router logits.
        torch.testing.assert_close(got.aux_loss, want.aux_loss, **FP32_TOL)
    num_blocks = EXPECTED[family][0]
    assert log.names.count("moe::route") == log.names.count("moe::experts") == num_blocks
    assert list(model.state_dict()) == keys


@pytest.mark.parametrize("family", FAMILIES)
def test_report_and_weight_sharing(family):
    model = make_model(family)
    before = {name: module.experts for name, module in model.named_modules()
              if hf.family_of(module) is not None}
    report = hf.patch(model)
    num_blocks, num_shared, num_converted = EXPECTED[family]
    assert report.patched == sorted(before) and len(before) == num_blocks
    assert report.families == {family: num_blocks}
    assert (report.shared_weights, report.converted_weights) == (num_shared, num_converted)
    assert report.skipped == {}
    blocks = _moe_blocks(model)
    assert sorted(blocks) == report.patched
    for block_report in report.blocks:
        block = blocks[block_report.name]
        assert block.experts is before[block_report.name]
        used = {tensor.data_ptr() for tensor in block.expert_weights() if tensor is not None}
        for name in block_report.shared:
            assert getattr(block.experts, name).data_ptr() in used
        # Converted ones are replaced by parameters in our layout, which the block reads.
        experts_params = dict(block.experts.named_parameters())
        assert not set(block_report.converted) & set(experts_params)
        assert used <= {param.data_ptr() for param in experts_params.values()}
    if family == "deepseek_v3":
        assert type(model.model.layers[0].mlp).__name__ == "DeepseekV3MLP"
    # Patched before transformers installed its output hooks: they find the routers.
    with torch.no_grad():
        router_logits = model(token_ids(), output_router_logits=True).get("router_logits")
    assert router_logits is None or len(router_logits) == num_blocks


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_matches_original(family):
    model = make_model(family)
    ids = token_ids(batch=1, seq=6)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
        hf.patch(model)
        got = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert want.shape == (1, 11)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_matches_original(family):
    """One block on the same input: the routing is identical (the logits are
    computed as transformers does) and only the experts' rounding differs (we
    accumulate in fp32). Whole models stay close on average, but a near tie that
    rounds the other way in a later layer can route one token differently."""
    model = make_model(family, dtype=torch.bfloat16)
    ids = token_ids()
    name = "model.layers.1.mlp"
    original = copy.deepcopy(model.get_submodule(name))
    x_BSH = torch.randn(2, 7, COMMON["hidden_size"], dtype=torch.bfloat16)
    with torch.no_grad():
        want_logits = model(ids).logits.float()
        hf.patch(model)
        got_logits = model(ids).logits.float()
        want, got = original(x_BSH), model.get_submodule(name)(x_BSH)
    if family == "gpt_oss":
        (want, want_scores_TK), (got, got_scores_TK) = want, got
        torch.testing.assert_close(got_scores_TK, want_scores_TK, rtol=0, atol=1e-2)
    assert got.shape == want.shape == x_BSH.shape and got.dtype == torch.bfloat16
    # transformers rounds every expert's output to bf16 before summing (up to ~1.3% of
    # the largest output off the fp32 result here), we round once (~0.3%).
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * want.abs().max().item())
    mean_error = (got_logits - want_logits).abs().mean()
    assert mean_error <= 0.02 * want_logits.abs().mean()


@pytest.mark.parametrize("family, dtype", [*((family, torch.float32) for family in FAMILIES),
                                           ("deepseek_v3", torch.bfloat16)])
def test_router_ignores_autocast(family, dtype):
    """Under autocast the patched router computes the logits as transformers does
    without it (in the router weight's dtype; DeepSeek-V3 in fp32): autocast does
    not round them to bf16, so it cannot change which experts a token goes to."""
    model = make_model(family, dtype=dtype)
    name = "model.layers.1.mlp"
    router_name = hf.family_of(model.get_submodule(name)).router
    original = copy.deepcopy(getattr(model.get_submodule(name), router_name))
    hf.patch(model)
    router = getattr(model.get_submodule(name), router_name)
    generator = torch.Generator().manual_seed(2)
    # Many tokens: some have near ties between experts that bf16 logits would flip.
    x_TH = torch.randn(512, COMMON["hidden_size"], generator=generator).to(dtype)
    with torch.no_grad():
        want_logits_TE = original(x_TH)[0]
        want = router(x_TH)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got_logits_TE, got_weights_TK, got_ids_TK = router(x_TH)
    assert got_logits_TE.dtype == (torch.float32 if family == "deepseek_v3" else dtype)
    torch.testing.assert_close(got_logits_TE, want_logits_TE, rtol=0, atol=0)
    torch.testing.assert_close(got_ids_TK, want[2], rtol=0, atol=0)
    torch.testing.assert_close(got_weights_TK, want[1], rtol=0, atol=0)


def grads_in_transformers_layout(model) -> dict[str, torch.Tensor | None]:
    """Parameter name -> gradient, the patched blocks' converted expert tensors' (GPT-OSS)
    under transformers' names and in its layout."""
    grads = {name: param.grad for name, param in model.named_parameters()}
    for block_name, block in _moe_blocks(model).items():
        for name, conversion in block.conversions.items():
            grad = grads.pop(f"{block_name}.experts.{name}")
            grads[f"{block_name}.experts.{conversion.source}"] = (
                None if grad is None else conversion.to_source(grad))
    return grads


def _assert_same_grads(model, original):
    want = {name: param.grad for name, param in original.named_parameters()}
    got = grads_in_transformers_layout(model)
    assert sorted(got) == sorted(want)
    for name, grad in got.items():
        assert (grad is None) == (want[name] is None), name
        if grad is not None:
            torch.testing.assert_close(grad, want[name], **FP32_TOL, msg=name)


def _backward_matches_original(model):
    """Backward through ``model`` unpatched (a copy) and patched: the same gradients.
    Returns the unpatched copy and the token ids."""
    original = copy.deepcopy(model)
    ids = token_ids()
    original(ids, labels=ids).loss.backward()
    hf.patch(model)
    model(ids, labels=ids).loss.backward()
    _assert_same_grads(model, original)
    return original, ids


@pytest.mark.parametrize("family", CANONICAL)
def test_gradients_match_original(family):
    _backward_matches_original(make_model(family).train())


def test_converted_blocks_train_their_own_parameters():
    """GPT-OSS's experts are held in our layout as parameters of their own: their
    gradients are transformers' in our layout, and an optimizer built after `patch`
    updates what the next eval-mode forward reads."""
    model = make_model("gpt_oss").train()
    original, ids = _backward_matches_original(model)
    for m in (model, original):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    model.eval()
    original.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, **FP32_TOL)


def test_converted_blocks_give_gradients_in_eval_mode():
    """An eval-mode model still builds a graph when grad is enabled: GPT-OSS's
    expert parameters (ours) get the gradients the unpatched model gives its own."""
    _backward_matches_original(make_model("gpt_oss").eval())


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_compiles_whole(family):
    model = make_model(family)
    hf.patch(model)
    ids = token_ids()
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(ids)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1
        torch._dynamo.reset()
        graphs = []
        inner = tmo.backend(inner="aot_eager")

        def recording_backend(gm, example_inputs):
            graphs.append(moe_op_sequence(gm))
            return inner(gm, example_inputs)

        compiled = torch.compile(model, backend=recording_backend, fullgraph=True)
        got, want = compiled(ids).logits, model(ids).logits
    torch.testing.assert_close(got, want, **FP32_TOL)
    num_blocks = EXPECTED[family][0]
    assert graphs == ["\n".join(["moe::route", "moe::experts"] * num_blocks)]


@pytest.mark.parametrize("family", FAMILIES)
def test_token_count_compiles_once(family):
    model = make_model(family)
    hf.patch(model)
    counter = CompileCounterWithBackend(tmo.backend(inner="aot_eager"))
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        for seq in (2, 7, 30, 5):
            ids = token_ids(seq=seq)
            torch._dynamo.mark_dynamic(ids, 1)
            torch.testing.assert_close(compiled(ids, use_cache=False).logits,
                                       model(ids, use_cache=False).logits, **FP32_TOL)
    assert counter.frame_count == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_static_cache_generate_compiles_whole(family):
    """``generate`` with a static KV cache, its decode steps compiled by transformers
    with our backend and ``fullgraph=True`` (a graph break raises): the tokens of the
    uncompiled model, and a second call reuses the graphs."""
    model = make_model(family)
    hf.patch(model)
    ids = token_ids(batch=2, seq=6)
    config = transformers.CompileConfig(fullgraph=True, backend=tmo.backend(inner="aot_eager"),
                                        mode=None)
    config._compile_all_devices = True  # transformers compiles on accelerators only otherwise
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False,
                  cache_implementation="static")
    with torch.no_grad():
        want = model.generate(ids, disable_compile=True, **kwargs)
        # (transformers copies the backend: Dynamo's own counters count the graphs)
        counters.clear()
        got = model.generate(ids, compile_config=config, **kwargs)
        graphs = counters["stats"]["unique_graphs"]
        again = model.generate(ids, compile_config=config, **kwargs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(again, want, rtol=0, atol=0)
    # One graph (GPT-OSS: more, as its sliding-window cache's position count, a Python
    # int, becomes dynamic and the window fills); the second call compiles nothing.
    assert graphs >= 1 and counters["stats"]["unique_graphs"] == graphs


# DeepSeek-V3: its first layer is dense. GPT-OSS: converted weights, whose record
# of their sources (a weak reference) must pickle too.
@pytest.mark.parametrize("family,router", [("deepseek_v3", "model.layers.1.mlp.gate"),
                                           ("gpt_oss", "model.layers.0.mlp.router")])
def test_patched_model_pickles(family, router, tmp_path):
    model = make_model(family)
    hf.patch(model)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert isinstance(loaded.get_submodule(router), hf.RoutedRouter)


@pytest.mark.parametrize("family", CANONICAL)
def test_experts_implementation(family):
    model = make_model(family)
    ids = token_ids()
    with torch.no_grad():
        want = model(ids).logits
        model.set_experts_implementation(hf.EXPERTS_IMPLEMENTATION)
        with OpLog() as log:
            got = model(ids).logits
    torch.testing.assert_close(got, want, **FP32_TOL)
    assert log.names.count("moe::experts") == EXPECTED[family][0]
    assert "moe::route" not in log.names  # the routing stays transformers'


def test_experts_implementation_compiles_whole():
    model = make_model("qwen2_moe")
    model.set_experts_implementation(hf.EXPERTS_IMPLEMENTATION)
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(token_ids())
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_from_pretrained_experts_implementation(tmp_path):
    model = make_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, experts_implementation=hf.EXPERTS_IMPLEMENTATION).eval()
    assert loaded.config._experts_implementation == hf.EXPERTS_IMPLEMENTATION
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, **FP32_TOL)


def test_renamed_parameters_map_transformers_names_to_the_patched_ones():
    model = make_model("gpt_oss")
    source_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    hf.patch(model)
    renamed = hf.renamed_parameters(model)
    block = "model.layers.0.mlp.experts"
    assert {k: v for k, v in renamed.items() if k.startswith(block + ".")} == {
        f"{block}.gate_up_proj": f"{block}.w13", f"{block}.gate_up_proj_bias": f"{block}.b13",
        f"{block}.down_proj": f"{block}.w2"}
    assert len(renamed) == 3 * EXPECTED["gpt_oss"][0]
    parameters = dict(model.named_parameters())
    for theirs, ours in renamed.items():
        # Our name, our layout; transformers' name only in the state dict.
        assert ours in parameters and theirs not in parameters
        assert theirs in model.state_dict()
        assert model.state_dict()[theirs].shape == source_shapes[theirs]
    # Every other parameter keeps transformers' name.
    assert set(parameters) - set(renamed.values()) == set(source_shapes) - set(renamed)
    olmoe = make_model("olmoe")
    hf.patch(olmoe)
    assert hf.renamed_parameters(olmoe) == {}


def test_experts_implementation_rejects_other_layouts():
    model = make_model("gpt_oss")
    model.set_experts_implementation(hf.EXPERTS_IMPLEMENTATION)
    with pytest.raises(ValueError, match=r"is_concatenated=True.*hf.patch"), torch.no_grad():
        model(token_ids())


def test_unsupported_activation_is_skipped_with_reason():
    model = make_model("qwen3_moe", hidden_act="gelu_pytorch_tanh")
    report = hf.patch(model)
    assert report.patched == [] and not _moe_blocks(model)
    assert sorted(report.skipped) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all("hidden_act" in reason for reason in report.skipped.values())


def test_patch_twice_and_bad_input():
    model = make_model("olmoe")
    hf.patch(model)
    again = hf.patch(model)
    assert again.patched == []
    assert set(again.skipped.values()) == {"already patched"}
    with pytest.raises(TypeError, match="torch.nn.Module"):
        hf.patch("olmoe")


def test_unknown_families_are_reported():
    class OtherMoE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.Linear(4, 4)

    model = torch.nn.Sequential(OtherMoE())
    report = hf.patch(model)
    assert report.patched == []
    assert "OtherMoE is not a supported family" in report.skipped["0"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_mid_size_compiled_with_cuda_graphs_matches_eager(dtype):
    """Real hidden sizes (Qwen3-30B-A3B's block shapes), two layers, CUDA graphs."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().to("cuda", dtype)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, 1024, (2, 64), generator=generator).cuda() for _ in range(4)]
    with torch.no_grad():
        want = [model(ids, use_cache=False).logits.float() for ids in batches]
        report = hf.patch(model)
        assert report.families == {"qwen3_moe": 2}
        eager = [model(ids, use_cache=False).logits.float() for ids in batches]
        compiled = torch.compile(model, backend=tmo.backend(mode="reduce-overhead"),
                                 fullgraph=True)
        # The first calls warm up and record the CUDA graph; the later ones replay it.
        got = [compiled(ids, use_cache=False).logits.float().clone() for ids in batches]
    # In bf16 Inductor's fusions of attention and norms alone move these logits by
    # ~2% (measured with experts="reference"), and our fp32 accumulation moves them
    # ~1% off transformers' eager experts.
    bound = 1e-3 if dtype == torch.float32 else 4e-2
    for got_BSV, eager_BSV, want_BSV in zip(got, eager, want):
        assert (got_BSV - eager_BSV).norm() <= bound * eager_BSV.norm()
        assert (eager_BSV - want_BSV).norm() <= bound * want_BSV.norm()
