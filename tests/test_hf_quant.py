"""Patched transformers models with quantized experts: GPT-OSS's MXFP4 and
DeepSeek-V3's fp8 experts, written here with the encodings of
tests/test_checkpoints.py, against the same models on the weights those stand for.

Legend: E experts, H hidden size, I expert intermediate size, F = 2 * I.

Bounds as in tests/test_checkpoints.py: MXFP4 W4A16 in fp32 matches the float
model on the weights read back to fp32's bound; fp8 w8a8 (DeepSeek-V3's dynamic
1 x bk activation groups) is within `W8A8_ATOL` of the largest logit.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file

import torch_moe_ops as tmo
from test_checkpoints import (
    W8A8_ATOL,
    fp8_blocks,
    fp8_read_back,
    mxfp4_blocks,
    mxfp4_read_back,
    save,
)
from test_hf import make_model, token_ids
from torch_moe_ops import hf
from torch_moe_ops.config import QuantSpec
from torch_moe_ops.hf.weights import QuantizedExperts

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

FP32 = {"rtol": 1e-5, "atol": 1e-5}
# fp8 blocks of the tiny DeepSeek-V3 (H = 32, I = 16): not square, so a transposed
# scale cannot pass.
BLOCK = (8, 16)


def assert_w8a8_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0,
                               atol=W8A8_ATOL * expected.abs().max().item())


def _moe_blocks(model) -> dict:
    return {name: module for name, module in model.named_modules()
            if isinstance(module, hf.HFMoEBlock)}


def write_gpt_oss_mxfp4(model, folder) -> dict[str, torch.Tensor]:
    """``model`` saved as GPT-OSS's MXFP4 checkpoint (experts as blocks and scales);
    returns, per block, the ``gate_up_proj [E, H, F]`` its file stands for."""
    model.save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    read_back = {}
    for name in [key.removesuffix(".experts.gate_up_proj") for key in state
                 if key.endswith(".experts.gate_up_proj")]:
        for proj in ("gate_up_proj", "down_proj"):
            # transformers holds [E, H, F] and [E, I, H]; the file, rows of [E, F, H], [E, H, I].
            rows = state.pop(f"{name}.experts.{proj}").transpose(1, 2)
            encoded = [mxfp4_blocks(w) for w in rows]
            state[f"{name}.experts.{proj}_blocks"] = torch.stack([b for b, _ in encoded])
            state[f"{name}.experts.{proj}_scales"] = torch.stack([s for _, s in encoded])
            if proj == "gate_up_proj":
                read_back[name] = torch.stack([mxfp4_read_back(b, s)
                                               for b, s in encoded]).transpose(1, 2)
    save(state, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(config))
    return read_back


def test_gpt_oss_mxfp4_checkpoint_loads_into_the_patched_model(tmp_path):
    read_back = write_gpt_oss_mxfp4(make_model("gpt_oss", intermediate_size=32), tmp_path)

    def load():
        # Without transformers' hub kernels MXFP4 is dequantized at load.
        return transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, quantization_config=transformers.Mxfp4Config(dequantize=True),
            dtype=torch.float32).eval()

    reference = load()
    for name, gate_up in read_back.items():
        # transformers reads the file as this test's encoding means it.
        assert torch.equal(reference.get_submodule(name).experts.gate_up_proj, gate_up)
    model = load()
    hf.patch(model)
    assert tmo.hf.load_into(model, tmp_path) == sorted(read_back)
    for block in _moe_blocks(model).values():
        assert isinstance(block.experts, QuantizedExperts)
        assert block.cfg.quant == QuantSpec("mxfp4")
        assert block.experts.w13.dtype == torch.uint8
        assert block.experts.b13.dtype == torch.float32
    assert "model.layers.0.mlp.experts.w13_scale" in model.state_dict()
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, **FP32)
    # A cast leaves the stored bits: only the biases follow the activations.
    experts = model.model.layers[0].mlp.experts
    stored = {name: getattr(experts, name).clone() for name in ("w13", "w13_scale", "w2")}
    model.to(torch.bfloat16)
    assert experts.b13.dtype == torch.bfloat16
    for name, tensor in stored.items():
        assert torch.equal(getattr(experts, name), tensor), name
    with torch.no_grad():
        assert model(ids).logits.isfinite().all()


def _fp8_experts(config, gate_up_q, gate_up_scale, down_q, down_scale):
    """transformers' FP8Experts (as from_pretrained builds it on a GPU that runs fp8)."""
    from transformers.integrations.finegrained_fp8 import FP8Experts

    experts = FP8Experts(config, block_size=BLOCK)
    with torch.no_grad():
        for name, tensor in (("gate_up_proj", gate_up_q), ("gate_up_proj_scale_inv", gate_up_scale),
                             ("down_proj", down_q), ("down_proj_scale_inv", down_scale)):
            getattr(experts, name).copy_(tensor)
    return experts


def test_deepseek_v3_fp8_experts_in_place_and_from_a_checkpoint(tmp_path):
    original = make_model("deepseek_v3")
    reference, in_place = copy.deepcopy(original), copy.deepcopy(original)
    inter = original.config.moe_intermediate_size
    files = {}
    for name, block in original.named_modules():
        if hf.family_of(block) is None:
            continue
        # Block rows never straddle gate and up (I % bn == 0): the whole [F, H]
        # matrix quantizes as its two halves would.
        gate_up = [fp8_blocks(w, BLOCK) for w in block.experts.gate_up_proj.detach()]
        down = [fp8_blocks(w, BLOCK) for w in block.experts.down_proj.detach()]
        with torch.no_grad():
            ref_experts = reference.get_submodule(name).experts
            ref_experts.gate_up_proj.copy_(torch.stack([fp8_read_back(q, s, BLOCK)
                                                        for q, s in gate_up]))
            ref_experts.down_proj.copy_(torch.stack([fp8_read_back(q, s, BLOCK) for q, s in down]))
        in_place.get_submodule(name).experts = _fp8_experts(
            original.config, *(torch.stack([t[i] for t in gate_up]) for i in (0, 1)),
            *(torch.stack([t[i] for t in down]) for i in (0, 1)))
        for e, ((q13, s13), (q2, s2)) in enumerate(zip(gate_up, down)):
            key, rows = f"{name}.experts.{e}", inter // BLOCK[0]
            files.update({f"{key}.gate_proj.weight": q13[:inter],
                          f"{key}.gate_proj.weight_scale_inv": s13[:rows],
                          f"{key}.up_proj.weight": q13[inter:],
                          f"{key}.up_proj.weight_scale_inv": s13[rows:],
                          f"{key}.down_proj.weight": q2, f"{key}.down_proj.weight_scale_inv": s2})
    save(files, tmp_path / "experts.safetensors")

    report = hf.patch(in_place)
    assert report.skipped == {} and report.converted_weights == 0
    assert report.blocks[0].shared == ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv",
                                       "down_proj_scale_inv")
    block = in_place.get_submodule(report.blocks[0].name)
    assert block.cfg.quant == QuantSpec("fp8_block", "fp8_group", BLOCK)
    assert block.expert_weights()[0] is block.experts.gate_up_proj
    assert block.expert_scales()[1] is block.experts.down_proj_scale_inv
    ids = token_ids()
    with torch.no_grad():
        got = in_place(ids).logits
        assert_w8a8_close(got, reference(ids).logits)

    # The same experts from a DeepSeek-V3-style file, into the float model patched.
    from_file = copy.deepcopy(original)
    hf.patch(from_file)
    assert hf.load_into(from_file, tmp_path / "experts.safetensors") == report.patched
    with torch.no_grad():
        assert torch.equal(from_file(ids).logits, got)


def test_transformers_mxfp4_block_is_reported_with_what_to_do():
    from transformers.integrations.mxfp4 import Mxfp4GptOssExperts, Mxfp4GptOssMLP

    model = make_model("gpt_oss", intermediate_size=32)
    block = model.model.layers[0].mlp
    model.model.layers[0].mlp = Mxfp4GptOssMLP(block.router, Mxfp4GptOssExperts(model.config))
    report = hf.patch(model)
    assert report.patched == ["model.layers.1.mlp"]
    assert report.skipped["model.layers.0.mlp"].endswith(
        "transformers' MXFP4 kernels hold the experts in their own swizzled layout: load the "
        "model with quantization_config=Mxfp4Config(dequantize=True), patch it, then "
        "torch_moe_ops.hf.load_into(model, checkpoint) for MXFP4 experts")


def write_deepseek_v3_fp8(model, folder) -> dict[str, torch.Tensor]:
    """``model`` saved as a DeepSeek-V3-style fp8 checkpoint: the routed experts in
    fp8 with block scales, everything else as it is. Returns, per block, the
    ``gate_up_proj [E, F, H]`` its file stands for."""
    model.save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    read = {}
    for key in [key for key in state if ".mlp.experts." in key]:
        q, scale = fp8_blocks(state[key], BLOCK)
        state[key], state[key.replace(".weight", ".weight_scale_inv")] = q, scale
        read[key] = fp8_read_back(q, scale, BLOCK)
    save(state, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "weight_block_size": list(BLOCK), "activation_scheme": "dynamic",
        "modules_to_not_convert": ["self_attn", "shared_experts", "lm_head", "mlp.gate",
                                   "model.layers.0.mlp"]}
    (folder / "config.json").write_text(json.dumps(config))
    blocks = sorted({key.split(".experts.")[0] for key in read})
    num_experts = model.config.n_routed_experts
    return {name: torch.stack([torch.cat([read[f"{name}.experts.{e}.{proj}.weight"]
                                          for proj in ("gate_proj", "up_proj")])
                               for e in range(num_experts)]) for name in blocks}


def _from_pretrained(folder, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             **kwargs).eval()


def test_deepseek_v3_fp8_checkpoint_through_transformers(tmp_path):
    """Without a GPU transformers dequantizes the fp8 experts at load: they read as
    this test's encoding means them (gate rows, then up rows), and `load_into`
    gives the patched model the checkpoint's fp8 experts."""
    pytest.importorskip("accelerate")  # transformers' fp8 loading needs it
    if torch.cuda.is_available():
        pytest.skip("on a GPU transformers keeps the fp8 experts: see the GPU test below")
    read_back = write_deepseek_v3_fp8(make_model("deepseek_v3"), tmp_path)
    reference = _from_pretrained(tmp_path)
    for name, gate_up in read_back.items():
        assert torch.equal(reference.get_submodule(name).experts.gate_up_proj, gate_up)
    model = _from_pretrained(tmp_path)
    hf.patch(model)
    assert hf.load_into(model, tmp_path) == sorted(read_back)
    ids = token_ids()
    with torch.no_grad():
        assert_w8a8_close(model(ids).logits, reference(ids).logits)


@pytest.mark.gpu
def test_deepseek_v3_fp8_checkpoint_on_the_gpu(tmp_path):
    """On a GPU that runs fp8 transformers loads the experts as FP8Experts: the
    patch runs them in place, against the same checkpoint dequantized."""
    pytest.importorskip("accelerate")
    # transformers runs every fp8 layer (attention's too) through the hub's
    # finegrained-fp8 kernel, which the `kernels` package fetches.
    pytest.importorskip("kernels")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("transformers runs fp8 from compute capability 8.9")
    write_deepseek_v3_fp8(make_model("deepseek_v3"), tmp_path)
    model = _from_pretrained(tmp_path, device_map="cuda")
    reference = _from_pretrained(
        tmp_path, device_map="cuda",
        quantization_config=transformers.FineGrainedFP8Config(dequantize=True))
    report = hf.patch(model)
    assert report.skipped == {} and report.converted_weights == 0
    for block in _moe_blocks(model).values():
        assert block.cfg.quant == QuantSpec("fp8_block", "fp8_group", BLOCK)
        assert block.expert_weights()[0].dtype == torch.float8_e4m3fn
    ids = token_ids().cuda()
    with torch.no_grad():
        assert_w8a8_close(model(ids).logits, reference(ids).logits)
