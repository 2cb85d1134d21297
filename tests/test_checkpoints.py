"""Quantized checkpoints (`torch_moe_ops.checkpoints`): DeepSeek-V3-style fp8 and
GPT-OSS-style MXFP4 files written here, loaded into `MoE` and into patched
transformers models, against float blocks on the weights the files stand for.

Legend: E experts, H hidden size, I expert intermediate size, F = 2 * I,
S shared-expert intermediate size, N / C rows / columns of one weight matrix.

The files are written by quantizers of this test's own (not `torch_moe_ops.quant`'s),
so the loader is checked against an independent encoding of each format:

- fp8 blocks: ``scale = amax(bn x bk block) / 448``, values cast to float8_e4m3fn;
- MXFP4: per 32 values ``e = floor(log2(amax)) - 2``; each value over ``2 ** e``
  goes to the nearest e2m1 magnitude by the midpoints between them (ties to the
  smaller), its sign in bit 3; element ``2j`` in the low nibble; scale byte ``e + 127``.

Bounds: weight-only formats (fp8 W8A16, MXFP4 W4A16) compute in fp32 what the float
block computes on the weights read back: fp32's bound (`FP32`). With fp8
activations (w8a8) every output is within `W8A8_ATOL` of the largest expected
magnitude: each activation is rounded to 3 mantissa bits (at most 1/16 of it)
and the rounding errors of a sum of H or I products mostly cancel.
"""

from __future__ import annotations

import json

import pytest
import torch

import torch_moe_ops as tmo
from test_quant import FakeGroup
from torch_moe_ops.config import QuantSpec

safetensors_torch = pytest.importorskip("safetensors.torch")

H, I, E, K, S = 64, 32, 4, 2, 32
BLOCK = (16, 32)
PREFIX = "model.layers.3.mlp"
FP32 = {"rtol": 1e-5, "atol": 1e-5}
W8A8_ATOL = 5e-2
# The e2m1 magnitudes and the midpoints between neighbours.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_MIDPOINTS = (E2M1[1:] + E2M1[:-1]) / 2


# This test's quantizers and the weights their output stands for.


def fp8_blocks(w_NC: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q fp8 [N, C], scale_inv fp32 [N / bn, C / bk])``, DeepSeek-V3's encoding."""
    (rows, cols), (bn, bk) = w_NC.shape, block
    blocks = w_NC.reshape(rows // bn, bn, cols // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)) / 448
    scale = torch.where(scale > 0, scale, 1.0)
    q = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
    return q, scale


def fp8_read_back(q: torch.Tensor, scale: torch.Tensor, block=BLOCK) -> torch.Tensor:
    return q.float() * scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)


def mxfp4_blocks(w_NC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks uint8 [N, C / 32, 16], scales uint8 [N, C / 32])``, GPT-OSS's encoding."""
    rows, cols = w_NC.shape
    groups = w_NC.reshape(rows, cols // 32, 32)
    amax = groups.abs().amax(dim=2)
    _, exponent = torch.frexp(amax)  # amax = m * 2**exponent, 0.5 <= m < 1
    e = torch.where(amax > 0, exponent - 1 - 2, -127).clamp(-127, 127)
    scaled = groups / torch.exp2(e.float())[..., None]
    nibbles = (torch.bucketize(scaled.abs().contiguous(), E2M1_MIDPOINTS)
               | ((scaled < 0).long() << 3))
    packed = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return packed.to(torch.uint8), (e + 127).to(torch.uint8)


def mxfp4_read_back(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    signed = torch.cat([E2M1, -E2M1])
    values = torch.stack([signed[(blocks & 0xF).long()], signed[(blocks >> 4).long()]], dim=-1)
    values = values.reshape(*scales.shape, 32) * torch.exp2(scales.float() - 127)[..., None]
    return values.reshape(scales.shape[0], -1)


def _randn(generator, *shape, fan_in=None):
    return torch.randn(shape, generator=generator) / (fan_in or 1) ** 0.5


# The checkpoints, and the float block state each stands for.


def deepseek_v3_block(generator, prefix=PREFIX) -> tuple[dict, dict]:
    """``(checkpoint tensors, float MoE state)`` of one DeepSeek-V3-style block."""
    tensors, w13, w2 = {}, [], []
    for e in range(E):
        read = {}
        for proj, (rows, cols) in (("gate_proj", (I, H)), ("up_proj", (I, H)),
                                   ("down_proj", (H, I))):
            q, scale = fp8_blocks(_randn(generator, rows, cols, fan_in=cols))
            tensors[f"{prefix}.experts.{e}.{proj}.weight"] = q
            tensors[f"{prefix}.experts.{e}.{proj}.weight_scale_inv"] = scale
            read[proj] = fp8_read_back(q, scale)
        w13.append(torch.cat([read["gate_proj"], read["up_proj"]]))
        w2.append(read["down_proj"])
    shared = {}
    for proj, (rows, cols) in (("gate_proj", (S, H)), ("up_proj", (S, H)), ("down_proj", (H, S))):
        q, scale = fp8_blocks(_randn(generator, rows, cols, fan_in=cols))
        tensors[f"{prefix}.shared_experts.{proj}.weight"] = q
        tensors[f"{prefix}.shared_experts.{proj}.weight_scale_inv"] = scale
        shared[proj] = fp8_read_back(q, scale)
    gate = _randn(generator, E, H).bfloat16()
    correction = torch.rand(E, generator=generator) / 10
    tensors[f"{prefix}.gate.weight"] = gate
    tensors[f"{prefix}.gate.e_score_correction_bias"] = correction
    state = {"gate.weight": gate.float(), "e_score_correction_bias": correction,
             "w13": torch.stack(w13), "w2": torch.stack(w2),
             "shared_experts.w13": torch.cat([shared["gate_proj"], shared["up_proj"]]),
             "shared_experts.w2": shared["down_proj"]}
    return tensors, state


def deepseek_v3_config(quant: QuantSpec | None, **fields) -> tmo.MoEConfig:
    return tmo.MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K,
                         scoring="sigmoid", correction_bias=True, renormalize=True,
                         routed_scaling_factor=2.5, shared_expert_intermediate_size=S,
                         quant=quant, **fields)


def interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's order of ``[E, I, ...]`` gate and up rows: ``[E, F, ...]``, gate rows even."""
    return torch.stack([gate, up], dim=2).flatten(1, 2)


def gpt_oss_block(generator, prefix=PREFIX) -> tuple[dict, dict]:
    """``(checkpoint tensors, float MoE state)`` of one GPT-OSS-style block."""
    gate_EIH, up_EIH = _randn(generator, E, I, H, fan_in=H), _randn(generator, E, I, H, fan_in=H)
    down_EHI = _randn(generator, E, H, I, fan_in=I)
    gate_bias, up_bias = _randn(generator, E, I) / 2, _randn(generator, E, I) / 2
    down_bias = _randn(generator, E, H) / 2
    gate_up_EFH = interleaved(gate_EIH, up_EIH)
    gate_up = [mxfp4_blocks(w) for w in gate_up_EFH]
    down = [mxfp4_blocks(w) for w in down_EHI]
    key = f"{prefix}.experts"
    tensors = {
        f"{key}.gate_up_proj_blocks": torch.stack([b for b, _ in gate_up]),
        f"{key}.gate_up_proj_scales": torch.stack([s for _, s in gate_up]),
        f"{key}.gate_up_proj_bias": interleaved(gate_bias, up_bias).bfloat16(),
        f"{key}.down_proj_blocks": torch.stack([b for b, _ in down]),
        f"{key}.down_proj_scales": torch.stack([s for _, s in down]),
        f"{key}.down_proj_bias": down_bias.bfloat16(),
        f"{prefix}.router.weight": _randn(generator, E, H).bfloat16(),
        f"{prefix}.router.bias": _randn(generator, E).bfloat16(),
    }
    read_gate_up = torch.stack([mxfp4_read_back(b, s) for b, s in gate_up])
    state = {"gate.weight": tensors[f"{prefix}.router.weight"].float(),
             "gate.bias": tensors[f"{prefix}.router.bias"].float(),
             "w13": torch.cat([read_gate_up[:, 0::2], read_gate_up[:, 1::2]], dim=1),
             "w2": torch.stack([mxfp4_read_back(b, s) for b, s in down]),
             "b13": torch.cat([gate_bias, up_bias], dim=1).bfloat16().float(),
             "b2": down_bias.bfloat16().float()}
    return tensors, state


def gpt_oss_config(quant: QuantSpec | None, **fields) -> tmo.MoEConfig:
    return tmo.MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K,
                         scoring="topk_softmax", router_bias=True, activation="swiglu_oai",
                         expert_bias=True, quant=quant, **fields)


LAYOUTS = {"deepseek_v3": (deepseek_v3_block, deepseek_v3_config, QuantSpec("fp8_block", "none",
                                                                             BLOCK)),
           "gpt_oss": (gpt_oss_block, gpt_oss_config, QuantSpec("mxfp4"))}


def save(tensors: dict, path) -> None:
    safetensors_torch.save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def float_block(state: dict, config) -> tmo.MoE:
    moe = tmo.MoE(config(None))
    moe.load_state_dict(state)
    return moe


def tokens(num_tokens: int = 9) -> torch.Tensor:
    return torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(7))


def assert_w8a8_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=0, atol=W8A8_ATOL * scale)
    assert not torch.equal(actual, expected)  # the activations were rounded


# MoE.load_quantized


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_weight_only_block_equals_float_block_on_the_weights_read_back(layout, generator,
                                                                        tmp_path):
    make, config, spec = LAYOUTS[layout]
    tensors, state = make(generator)
    save(tensors, tmp_path / "model.safetensors")
    moe = tmo.MoE(config(spec))
    moe.load_quantized(tmp_path / "model.safetensors", PREFIX)
    with torch.no_grad():
        torch.testing.assert_close(moe(tokens()), float_block(state, config)(tokens()), **FP32)
    # The checkpoint's bytes, kept: nothing was requantized.
    assert moe.w13.dtype == (torch.uint8 if layout == "gpt_oss" else torch.float8_e4m3fn)
    if layout == "deepseek_v3":
        gate_q = tensors[f"{PREFIX}.experts.1.gate_proj.weight"]
        assert torch.equal(moe.w13[1, :I].view(torch.uint8), gate_q.view(torch.uint8))
        down_scale = tensors[f"{PREFIX}.experts.2.down_proj.weight_scale_inv"]
        assert torch.equal(moe.w2_scale[2], down_scale)
    else:
        blocks = tensors[f"{PREFIX}.experts.gate_up_proj_blocks"]
        assert torch.equal(moe.w13[:, :I], blocks[:, 0::2].flatten(2))  # gate rows
        assert torch.equal(moe.w13[:, I:], blocks[:, 1::2].flatten(2))  # up rows


def test_fp8_activations_within_the_w8a8_bound(generator, tmp_path):
    tensors, state = deepseek_v3_block(generator)
    save(tensors, tmp_path / "model.safetensors")
    moe = tmo.MoE(deepseek_v3_config(QuantSpec("fp8_block", block_size=BLOCK)))
    moe.load_quantized(tmp_path / "model.safetensors", PREFIX)
    with torch.no_grad():
        assert_w8a8_close(moe(tokens()), float_block(state, deepseek_v3_config)(tokens()))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sharded_checkpoint_folders(layout, generator, tmp_path):
    make, config, spec = LAYOUTS[layout]
    tensors, _ = make(generator)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    indexed, plain = tmp_path / "indexed", tmp_path / "plain"
    for folder in (indexed, plain):
        folder.mkdir()
        for file, keys in shards.items():
            save({key: tensors[key] for key in keys}, folder / file)
    weight_map = {key: file for file, keys in shards.items() for key in keys}
    (indexed / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save(tensors, tmp_path / "one.safetensors")
    blocks = []
    for path in (indexed, plain, tmp_path / "one.safetensors"):
        moe = tmo.MoE(config(spec))
        moe.load_quantized(path, PREFIX)
        blocks.append(moe.state_dict())
    for state in blocks[1:]:
        for name, tensor in blocks[0].items():
            assert torch.equal(state[name].view(torch.uint8), tensor.view(torch.uint8)), name


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_expert_parallel_reads_this_ranks_experts(layout, generator, tmp_path):
    make, config, spec = LAYOUTS[layout]
    tensors, _ = make(generator)
    save(tensors, tmp_path / "model.safetensors")
    whole = tmo.MoE(config(spec))
    whole.load_quantized(tmp_path / "model.safetensors", PREFIX)
    sharded = tmo.MoE(config(spec, ep_size=2, max_tokens_per_rank=8), ep_group=FakeGroup(1))
    sharded.load_quantized(tmp_path / "model.safetensors", PREFIX)
    for name, tensor in sharded.state_dict().items():
        expected = whole.state_dict()[name]
        if name.startswith(("w13", "w2", "b13", "b2")):
            expected = expected[E // 2:]
        assert torch.equal(tensor.view(torch.uint8), expected.view(torch.uint8)), name


def _bad_loads(generator, tmp_path):
    deepseek, _ = deepseek_v3_block(generator)
    save(deepseek, tmp_path / "deepseek.safetensors")
    gpt_oss, _ = gpt_oss_block(generator)
    save(gpt_oss, tmp_path / "gpt_oss.safetensors")
    bf16 = {k: v.bfloat16() if k.endswith("proj.weight") else v for k, v in deepseek.items()}
    save(bf16, tmp_path / "bf16.safetensors")
    no_down = {k: v for k, v in gpt_oss.items() if not k.endswith("down_proj_blocks")}
    save(no_down, tmp_path / "no_down.safetensors")
    path = str(tmp_path / "deepseek.safetensors")
    return {
        "no_quant": (deepseek_v3_config(None), "deepseek", PREFIX,
                     ("moe.cfg.quant must be a QuantSpec to load a quantized checkpoint "
                      "(QuantSpec('fp8_block') for DeepSeek-V3's, QuantSpec('mxfp4') for "
                      "GPT-OSS's), got None")),
        "wrong_format": (gpt_oss_config(QuantSpec("mxfp4")), "deepseek", PREFIX,
                         (f"moe.cfg.quant must have weights='fp8_block' and block_size=(16, 32) "
                          f"for the deepseek_v3 checkpoint {path!r} (activations as you choose), "
                          f"got {QuantSpec('mxfp4')}")),
        "wrong_block": (deepseek_v3_config(QuantSpec("fp8_block", block_size=(32, 32))),
                        "deepseek", PREFIX,
                        (f"moe.cfg.quant must have weights='fp8_block' and block_size=(16, 32) "
                         f"for the deepseek_v3 checkpoint {path!r} (activations as you choose), "
                         f"got {QuantSpec('fp8_block', block_size=(32, 32))}")),
        "wrong_prefix": (deepseek_v3_config(QuantSpec("fp8_block", block_size=BLOCK)),
                         "deepseek", "model.layers.4.mlp",
                         ("prefix must name an MoE block of a quantized checkpoint (one of "
                          "'model.layers.4.mlp.experts.0.gate_proj.weight', "
                          "'model.layers.4.mlp.experts.gate_up_proj_blocks' in "
                          f"{path!r}), got 'model.layers.4.mlp'")),
        "float_experts": (deepseek_v3_config(QuantSpec("fp8_block", block_size=BLOCK)), "bf16",
                          PREFIX,
                          (f"{PREFIX}.experts.0.gate_proj.weight must have dtype in "
                           "(float8_e4m3fn) (DeepSeek-V3-style fp8 weights), got bfloat16")),
        "missing_tensor": (gpt_oss_config(QuantSpec("mxfp4")), "no_down", PREFIX,
                           (f"checkpoint file {str(tmp_path / 'no_down.safetensors')!r} has no "
                            f"tensor '{PREFIX}.experts.down_proj_blocks': expected GPT-OSS's "
                            f"MXFP4 experts under '{PREFIX}' (layout 'gpt_oss', as its "
                            "'experts.gate_up_proj_blocks' says), which hold it")),
        "no_file": (gpt_oss_config(QuantSpec("mxfp4")), "missing", PREFIX,
                    ("path must be a .safetensors file or a folder holding them, got "
                     f"{str(tmp_path / 'missing.safetensors')!r}")),
    }


@pytest.mark.parametrize("case", ["no_quant", "wrong_format", "wrong_block", "wrong_prefix",
                                  "float_experts", "missing_tensor", "no_file"])
def test_bad_loads_name_what_is_wrong(case, generator, tmp_path):
    config, file, prefix, message = _bad_loads(generator, tmp_path)[case]
    moe = tmo.MoE(config)
    with pytest.raises(ValueError) as error:
        moe.load_quantized(tmp_path / f"{file}.safetensors", prefix)
    assert str(error.value) == message


def test_meta_built_block_loads(generator, tmp_path):
    """A block too large to build in float first: meta device, to_empty, load."""
    tensors, state = gpt_oss_block(generator)
    save(tensors, tmp_path / "model.safetensors")
    with torch.device("meta"):
        moe = tmo.MoE(gpt_oss_config(QuantSpec("mxfp4")))
    moe.to_empty(device="cpu")
    moe.load_quantized(tmp_path / "model.safetensors", PREFIX)
    with torch.no_grad():
        torch.testing.assert_close(moe(tokens()), float_block(state, gpt_oss_config)(tokens()),
                                   **FP32)
