"""MXFP4 weights read by the GEMM kernels as fragments (`mxfp4_fragments`): the layout,
when it is prepared and when the stored weights run instead, and the tiled and the decode
kernels on it against the reference backend.

Without CUDA the kernels run under the Triton interpreter, where the fragments are decoded
in Triton arithmetic for fp32 and fp16 activations (the interpreter mishandles bf16);
`tests/test_mxfp4_ptx.py` runs the GPU's decode on the CPU. The ``gpu`` tests run bf16 at
GPT-OSS's widths.
"""

import dataclasses

import pytest
import torch

from conftest import make_quant_inputs
from test_triton_quant import assert_close_to, assert_norm_close, gpu_inputs
from torch_moe_ops import quant
from torch_moe_ops.backends.common import TRITON_INSTALLED
from torch_moe_ops.config import QuantSpec

if TRITON_INSTALLED:  # otherwise every test here skips (the `triton` marker)
    from torch_moe_ops.backends.triton import configs, fused, mxfp4_fragments

pytestmark = pytest.mark.triton
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MXFP4 = QuantSpec("mxfp4")
BOUNDS = {torch.float32: 1e-5, torch.float16: 5e-3}


def weights_of(words: torch.Tensor, scales: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The fp32 ``[E, N, K]`` weights that fragments stand for, read back as the kernels
    read them: thread (w, g, t), word s, pair (o, q), value h of block (nb, kb) is row
    64 nb + 16 w + 8 q + g, column 64 kb + 16 s + 8 o + 2 t + h."""
    num_experts = words.shape[0]
    row_blocks, col_blocks = num_rows // 64, words.shape[2] // 2048
    bits = words.view(torch.int32).view(num_experts, row_blocks, col_blocks, 4, 8, 4, 4)
    values = torch.zeros(*bits.shape, 2, 2, 2)  # ... (o, q, h)
    for pair, positions in enumerate(mxfp4_fragments.PAIR_BITS):
        for half in (0, 1):
            sign, e1, e0, mantissa = (((bits >> (p + 16 * half)) & 1) for p in positions)
            nibble = sign * 8 + e1 * 4 + e0 * 2 + mantissa
            magnitude = torch.tensor(quant.E2M1_VALUES)[nibble & 7]
            values[..., pair // 2, pair % 2, half] = torch.where(sign > 0, -magnitude, magnitude)
    # Scale bytes (w, g, sg, q) hold s + 126: the factor 2 ** (s - 127).
    s = scales.view(num_experts, row_blocks, col_blocks, 4, 8, 2, 2).int() - 126
    factor = 2.0 ** (s.float() - 127)
    # [E, nb, kb, w, g, t, s, o, q, h] times the factor of (w, g, s // 2, q).
    factor = factor[:, :, :, :, :, None, :, None, None, :, None].expand(
        *values.shape[:5], 4, 2, 2, 2, 2, 2).reshape(values.shape)
    values = values * factor
    # -> [E, nb, w, q, g, kb, s, o, t, h]
    values = values.permute(0, 1, 3, 8, 4, 2, 6, 7, 5, 9)
    return values.reshape(num_experts, num_rows, col_blocks * 64)


@pytest.mark.parametrize("rows, cols", [(64, 64), (192, 128), (128, 320)])
def test_prepared_fragments_hold_the_weights(rows, cols, generator):
    q = make_quant_inputs(generator, MXFP4, num_tokens=1, hidden_size=cols,
                          intermediate_size=rows // 2, num_experts=3, top_k=1)
    words, scales = mxfp4_fragments.prepare(q.w13, q.w13_scale)
    assert words.shape == (3, rows // 64, cols // 64 * 2048) and words.dtype == torch.uint8
    assert scales.shape == (3, rows // 64, cols // 64 * 128) and scales.dtype == torch.uint8
    torch.testing.assert_close(weights_of(words, scales, rows),
                               quant.dequantize_weights(q.w13, q.w13_scale, MXFP4),
                               atol=0, rtol=0)


def test_prepared_a_few_experts_at_a_time_alike(generator, monkeypatch):
    """Made in chunks of experts (one expert, then two, a time), the layout is the same."""
    q = make_quant_inputs(generator, MXFP4, num_tokens=1, hidden_size=128,
                          intermediate_size=64, num_experts=5, top_k=1)
    whole = mxfp4_fragments.prepare(q.w13, q.w13_scale)
    expert_bytes = q.w13[0].numel()
    for experts_a_time in (1, 2):
        monkeypatch.setattr(mxfp4_fragments, "CHUNK_BYTES", experts_a_time * expert_bytes)
        for made, expected in zip(mxfp4_fragments.prepare(q.w13, q.w13_scale), whole):
            assert torch.equal(made, expected)


def test_weights_the_layout_cannot_hold_are_not_prepared(generator):
    q = make_quant_inputs(generator, MXFP4, num_tokens=1, hidden_size=128,
                          intermediate_size=64, num_experts=2, top_k=1)
    scale = q.w13_scale.clone()
    scale[1, 5, 0] = mxfp4_fragments.LARGEST_SCALE_BYTE
    assert mxfp4_fragments.prepare(q.w13, scale) is not None
    scale[1, 5, 0] = mxfp4_fragments.LARGEST_SCALE_BYTE + 1
    assert mxfp4_fragments.prepare(q.w13, scale) is None
    # 96 columns: a block of 64 and half of another.
    q = make_quant_inputs(generator, MXFP4, num_tokens=1, hidden_size=96,
                          intermediate_size=64, num_experts=2, top_k=1)
    assert mxfp4_fragments.prepare(q.w13, q.w13_scale) is None


def run_path(q, monkeypatch, path: str, block_n: int, block_k: int, num_warps: int = 4,
             split_k: int = 1):
    """The triton and reference backends' outputs on ``path``'s kernels (``tiled`` or
    ``direct``, its K in ``split_k`` parts) with tiles of ``block_n`` x ``block_k`` and
    ``num_warps``, and whether each call's GEMMs read fragments."""
    flags = []
    real_gemm_weights = fused._gemm_weights

    def spy(*args):
        weights = real_gemm_weights(*args)
        flags.append(weights[2])
        return weights

    def pick(*key):
        config = configs.default_config(*key)
        return dataclasses.replace(config, path=path, BLOCK_M=16, BLOCK_N=block_n,
                                   BLOCK_K=block_k, num_warps=num_warps, SPLIT_K=split_k)

    monkeypatch.setattr(fused, "_gemm_weights", spy)
    monkeypatch.setattr(fused, "get_config", pick)
    args = q.args("swiglu_oai", 1.702, 1.0)
    return (torch.ops.moe_triton.experts_quant(*args),
            torch.ops.moe_reference.experts_quant(*args), flags)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the interpreter's decode (fp32, fp16)")
@pytest.mark.parametrize("path", ["tiled", "direct"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_n, block_k, hidden, inter",
                         [(64, 64, 128, 64), (128, 128, 192, 128), (64, 128, 320, 64)],
                         ids=["whole", "partial-blocks", "partial-k"])
def test_kernels_on_fragments(path, block_n, block_k, hidden, inter, dtype, generator,
                              monkeypatch):
    q = make_quant_inputs(generator, MXFP4, num_tokens=6, hidden_size=hidden,
                          intermediate_size=inter, num_experts=4, top_k=2, dtype=dtype,
                          bias=True, skip_fraction=0.2)
    out, ref, flags = run_path(q, monkeypatch, path, block_n, block_k)
    assert flags == [True]
    assert_close_to(out, ref, BOUNDS[dtype])


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the interpreter's decode (fp32, fp16)")
def test_decode_kernels_on_fragments_in_k_parts(generator, monkeypatch):
    """K in parts of whole blocks: H=192 in 3 parts of 64, I=128 in 2."""
    q = make_quant_inputs(generator, MXFP4, num_tokens=3, hidden_size=192,
                          intermediate_size=128, num_experts=4, top_k=2, bias=True,
                          skip_fraction=0.2)
    out, ref, flags = run_path(q, monkeypatch, "direct", 64, 64, split_k=3)
    assert flags == [True]
    assert_close_to(out, ref, BOUNDS[torch.float32])


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the interpreter's decode (fp32, fp16)")
def test_scales_past_the_layout_run_the_stored_weights(generator, monkeypatch):
    q = make_quant_inputs(generator, MXFP4, num_tokens=6, hidden_size=128,
                          intermediate_size=64, num_experts=4, top_k=2, bias=True)
    q.w2_scale[2, 7, 1] = mxfp4_fragments.LARGEST_SCALE_BYTE + 3
    out, ref, flags = run_path(q, monkeypatch, "tiled", 64, 64)
    assert flags == [False]
    assert_close_to(out, ref, BOUNDS[torch.float32])


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the interpreter's decode (fp32, fp16)")
def test_without_memory_to_spare_a_layer_reads_its_stored_weights(generator, monkeypatch):
    """A copy that would leave the GPU less than its reserve is not made: the layer reads
    its packed weights, a warning says so, and the decision is kept with the layer (its
    next call neither copies nor asks again)."""
    mxfp4_fragments.clear_prepared_weights()
    asked = []

    def spare(device):
        asked.append(device)
        return mxfp4_fragments.WORKSPACE_BYTES

    monkeypatch.setattr(mxfp4_fragments, "spare_bytes", spare)
    q = make_quant_inputs(generator, MXFP4, num_tokens=6, hidden_size=128,
                          intermediate_size=64, num_experts=4, top_k=2, bias=True)
    with pytest.warns(UserWarning, match="read their packed weights instead"):
        out, ref, flags = run_path(q, monkeypatch, "tiled", 64, 64)
    assert flags == [False]
    assert_close_to(out, ref, BOUNDS[torch.float32])
    assert run_path(q, monkeypatch, "tiled", 64, 64)[2] == [False]
    assert len(asked) == 1
    # With the copy's bytes to spare it is made.
    mxfp4_fragments.clear_prepared_weights()
    monkeypatch.setattr(mxfp4_fragments, "spare_bytes", lambda device: 1 << 40)
    assert run_path(q, monkeypatch, "tiled", 64, 64)[2] == [True]


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the interpreter's decode (fp32, fp16)")
def test_switched_off_the_kernels_read_the_stored_weights(generator, monkeypatch):
    """``TORCH_MOE_OPS_MXFP4_FRAGMENTS=0`` (memory over speed): no fragments are made."""
    monkeypatch.setenv(mxfp4_fragments.ENABLE_ENV, "0")
    mxfp4_fragments.clear_prepared_weights()
    q = make_quant_inputs(generator, MXFP4, num_tokens=6, hidden_size=128,
                          intermediate_size=64, num_experts=4, top_k=2, bias=True)
    out, ref, flags = run_path(q, monkeypatch, "tiled", 64, 64)
    assert flags == [False] and len(mxfp4_fragments._FRAGMENTS) == 0
    assert_close_to(out, ref, BOUNDS[torch.float32])


@pytest.mark.gpu
@pytest.mark.parametrize("block_n, block_k, warps", [(64, 64, 4), (128, 128, 8),
                                                     (128, 64, 4)])
@pytest.mark.parametrize("path, T, split_k", [("tiled", 7, 1), ("tiled", 333, 1),
                                              ("direct", 1, 1), ("direct", 5, 1),
                                              ("direct", 1, 4), ("direct", 5, 8)])
def test_gpt_oss_fragments_gpu(path, T, split_k, block_n, block_k, warps, monkeypatch):
    q = gpu_inputs(MXFP4, num_tokens=T, hidden_size=2880, intermediate_size=2880,
                   num_experts=8, top_k=4, bias=True)
    out, ref, flags = run_path(q, monkeypatch, path, block_n, block_k, warps, split_k)
    assert flags == [True]
    assert_norm_close(out, ref, MXFP4)


@pytest.mark.gpu
@pytest.mark.parametrize("path, T, split_k", [("tiled", 33, 1), ("direct", 1, 4),
                                              ("direct", 5, 1)])
def test_gpt_oss_stored_weights_without_memory_to_spare_gpu(path, T, split_k, monkeypatch):
    """A GPU without memory to spare for the copy: the tuned tiles (whole 64 x 64 blocks,
    K in parts) read the packed weights."""
    mxfp4_fragments.clear_prepared_weights()
    monkeypatch.setattr(mxfp4_fragments, "spare_bytes", lambda device: 0)
    q = gpu_inputs(MXFP4, num_tokens=T, hidden_size=2880, intermediate_size=2880,
                   num_experts=8, top_k=4, bias=True)
    with pytest.warns(UserWarning, match="read their packed weights instead"):
        out, ref, flags = run_path(q, monkeypatch, path, 64, 64, 4, split_k)
    assert flags == [False]
    assert_norm_close(out, ref, MXFP4)
