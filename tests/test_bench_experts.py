"""benchmarks/bench_experts.py end to end on the CPU (``--smoke``: every weight format,
the floors, the targets, the short table), and vLLM's Triton kernel as its peer
(benchmarks/peer_vllm.py) in bf16 and both fp8 modes, where vLLM's source is at hand
(``.peers/vllm``, git-ignored: these tests skip without it, as in CI).

Legend: T tokens, H hidden size, I expert intermediate size, E experts, K experts
per token, S = T * K routed slots, F = 2 * I.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import BENCHMARKS
from torch_moe_ops import quant
from torch_moe_ops.config import QuantSpec

pytestmark = pytest.mark.usefixtures("benchmarks_importable")
SMOKE_FORMATS = ("bf16", "fp8_block", "fp8_channel", "mxfp4")
# The quantized reference against the unquantized experts at the smoke widths
# (H = 256, I = 128: few terms per dot product to average rounding out): what
# rounding to each format costs there is about 6% (fp8) and 20% (mxfp4); a
# wrong scale or layout costs 100%.
QUANTIZATION_ERROR_BOUND = {"bf16": 1e-5, "fp8_block": 0.12, "fp8_channel": 0.12,
                            "mxfp4": 0.35}
FP8_MODES = {"fp8_block": QuantSpec("fp8_block"), "fp8_channel": QuantSpec("fp8_channel")}




@pytest.fixture
def peer_vllm():
    import peer_vllm

    return peer_vllm


def _needs_vllm_source(peer_vllm) -> None:
    path = Path(peer_vllm.source_root()) / peer_vllm.FP8_UTILS
    if peer_vllm.kernel_file() is None or not path.is_file():
        pytest.skip(f"no vLLM source at {peer_vllm.source_root()} (benchmarks/peer_vllm.py "
                    "says how to fill it)")


def run_smoke(out: Path, *args: str) -> tuple[str, dict]:
    result = subprocess.run([sys.executable, str(BENCHMARKS / "bench_experts.py"), "--smoke",
                             "--out", str(out), *args],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    with open(out / "experts.json") as f:
        return result.stdout, json.load(f)


def test_smoke_runs_every_format(tmp_path):
    stdout, data = run_smoke(tmp_path, "--tokens", "1,16", "--peers", "hf")
    rows = data["rows"]
    assert {(r["shape"], r["format"]) for r in rows} == {
        (shape, fmt) for shape in ("smoke", "smoke-oai") for fmt in SMOKE_FORMATS}
    references = [r for r in rows if r["backend"] == "reference"]
    assert len(references) == 2 * len(SMOKE_FORMATS) * 2
    for r in references:
        assert r["err_bf16"] < QUANTIZATION_ERROR_BOUND[r["format"]], r
        assert r["floor_us"] > 0 and not r["nan"], r
    # Backends without kernels for a format are left out with their reason.
    assert any(s["format"] == "mxfp4" and s["backend"] == "triton" and s["reason"]
               for s in data["header"]["skipped"])
    assert (tmp_path / "experts.csv").is_file()
    # The short table comes last: its header, then one line per shape, T and format.
    lines = stdout.strip().splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("shape ")
                                   and "vLLM us" in line)):]
    assert len(table) == 1 + 2 * 2 * len(SMOKE_FORMATS)
    assert any(line.startswith("decode (T=1, 16) within 1.3x") for line in lines)


@pytest.mark.parametrize("name, expected", [
    ("bf16", 2 * 3 * 256 * 128),
    ("fp8_block", 3 * 256 * 128 + 4 * 3 * 256 * 128 // 128**2),
    ("fp8_channel", 3 * 256 * 128 + 4 * (2 * 128 + 256)),
    ("fp8_tensor", 3 * 256 * 128 + 4 * 2),
    ("mxfp4", 3 * 256 * 128 // 2 + 3 * 256 * 128 // 32)])
def test_floor_bytes_per_format(name, expected):
    """What one expert (H = 256, I = 128) stores in each format, weights and scales:
    the bytes of its memory floor."""
    from weight_formats import expert_weights

    E, H, I = 2, 256, 128
    w13_EFH, w2_EHI = torch.randn(E, 2 * I, H).bfloat16(), torch.randn(E, H, I).bfloat16()
    assert expert_weights(name, w13_EFH, w2_EHI, None, None).bytes_per_expert() == expected


def test_bad_formats_name_the_flag(tmp_path):
    import bench_experts

    with pytest.raises(SystemExit, match=r"--formats must be comma-separated names from "
                                         r"bf16, .*got 'bf16,int4'"):
        bench_experts.main(["--smoke", "--out", str(tmp_path), "--formats", "bf16,int4"])


def _routing(generator, num_tokens: int, num_experts: int, top_k: int, device):
    ids_TK = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k]
                          for _ in range(num_tokens)]).int().to(device)
    weights_TK = torch.rand(num_tokens, top_k, generator=generator).to(device)
    return weights_TK, ids_TK


@pytest.mark.triton
@pytest.mark.parametrize("name", FP8_MODES)
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_vllm_fp8_gemm_reads_our_scales(peer_vllm, name, num_tokens):
    """One launch of vLLM's kernel in each fp8 mode, on our quantized weights and
    activations quantized by `torch_moe_ops.quant`, against the same product in fp32:
    strides and scale layouts as the peer passes them (at T=1 the one-block-per-slot
    path, at 16 the aligned one)."""
    _needs_vllm_source(peer_vllm)
    from torch_moe_ops.backends.common.kernels.align import align_rows

    spec = FP8_MODES[name]
    generator = torch.Generator().manual_seed(num_tokens)
    E, N, K_cols, top_k = 8, 256, 128, 2
    x_TK = torch.randn(num_tokens, K_cols, generator=generator)
    w_ENK = torch.randn(E, N, K_cols, generator=generator) * K_cols**-0.5
    weights_TK, ids_TK = _routing(generator, num_tokens, E, top_k, "cpu")
    q_ENK, w_scale = quant.quantize_weights(w_ENK, spec)
    a_TK, a_scale = quant.quantize_activations(x_TK, spec)
    # The kernel reads per-token scales as [T, 1], as vLLM's quantizer writes them.
    a_scale_TG = a_scale.reshape(num_tokens, -1)
    mode = peer_vllm.mode_of(spec)
    config = peer_vllm.default_config(num_tokens, E, mode)
    S = num_tokens * top_k
    if S * 4 <= E:
        sorted_ids, block_expert = None, ids_TK.view(-1)
        num_padded = torch.full((1,), S * config["BLOCK_SIZE_M"], dtype=torch.int32)
        num_rows = S * config["BLOCK_SIZE_M"]
    else:
        sorted_ids, block_expert, num_padded = align_rows(ids_TK, E, config["BLOCK_SIZE_M"])
        num_rows = sorted_ids.numel()
    out_SN = torch.empty(S, N)
    kernel = peer_vllm.load_jit(peer_vllm.kernel_file(), peer_vllm.KERNEL)
    peer_vllm._gemm(kernel, a_TK, a_scale_TG, q_ENK, w_scale, out_SN, weights_TK, sorted_ids,
                    block_expert, num_padded, num_rows, top_k, False, config, mode,
                    torch.float32)
    w_read_ENK = quant.dequantize_weights(q_ENK, w_scale, spec)
    x_read_TK = quant.dequantize_activations(a_TK, a_scale, spec)
    expected_SN = torch.stack([x_read_TK[s // top_k] @ w_read_ENK[ids_TK.view(-1)[s]].T
                               for s in range(S)])
    torch.testing.assert_close(out_SN, expected_SN, rtol=1e-5, atol=1e-5)


@pytest.mark.triton
def test_smoke_runs_vllm_in_every_mode(tmp_path, peer_vllm):
    """The whole peer (align, both GEMMs, vLLM's activation quantizer, sum) under the
    interpreter. bf16 matches the reference to fp32 rounding. fp8 is looser than on a
    GPU: Triton 3.9's interpreter casts fp32 to e4m3 without carrying a rounding into
    the exponent (7.9 becomes 4.0, not 8.0), so a few activations vLLM's Triton
    quantizer rounds there lose half their value."""
    _needs_vllm_source(peer_vllm)
    _, data = run_smoke(tmp_path, "--shapes", "smoke", "--tokens", "1,16", "--formats",
                        "bf16,fp8_block,fp8_channel", "--peers", "vllm")
    peers = {(r["format"], r["tokens"]): r for r in data["rows"] if r["backend"] == "vllm-triton"}
    assert set(peers) == {(f, t) for f in ("bf16", "fp8_block", "fp8_channel") for t in (1, 16)}
    for (fmt, _), r in peers.items():
        assert r["rel_err"] < (1e-5 if fmt == "bf16" else 0.15), r


@pytest.mark.gpu
@pytest.mark.parametrize("name", FP8_MODES)
@pytest.mark.parametrize("num_tokens", [1, 16, 300])
def test_vllm_fp8_peer_matches_the_reference_on_the_gpu(peer_vllm, name, num_tokens):
    """The peer in bf16 on the GPU (sm90: its swapped-operand tiles at small M) is
    closer to the quantized reference than quantization is to the bf16 experts."""
    _needs_vllm_source(peer_vllm)
    from bench_experts import Shape, make_problem, make_weights
    from weight_formats import expert_weights

    generator = torch.Generator(device="cuda").manual_seed(num_tokens)
    shape = Shape(16, 4, 512, 256)
    weights = make_weights(shape, generator)
    hidden_TH, weights_TK, ids_TK, *_ = make_problem(shape, num_tokens, weights, generator)
    stored = expert_weights(name, *weights)
    problem = (hidden_TH, weights_TK, ids_TK, stored.w13, stored.w2, None, None)
    peer = peer_vllm.vllm_peers(shape, num_tokens, problem, stored.spec,
                                (stored.w13_scale, stored.w2_scale))["vllm-triton"]()
    static = ("silu", 1.702, 7.0)
    reference = torch.ops.moe_reference.experts_quant(hidden_TH, weights_TK, ids_TK,
                                                      *stored.op_args(), *static)
    unquantized = torch.ops.moe_reference.experts(hidden_TH, weights_TK, ids_TK, *weights,
                                                  *static)

    def error(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    assert error(peer, reference) < 0.5 * error(reference, unquantized)


def test_flashinfer_rows_select_formats_tokens_and_backends(tmp_path):
    """``--flashinfer-rows`` picks FlashInfer's three formats (and its backends, peers and
    token counts unless given); ``--backends`` leaves the others out. Decode rows keep
    their byte floor, and the tables give its fraction."""
    stdout, data = run_smoke(tmp_path, "--flashinfer-rows", "--shapes", "smoke",
                             "--tokens", "1,64", "--backends", "reference", "--peers", "none")
    rows = data["rows"]
    assert {r["format"] for r in rows} == {"bf16", "fp8_block", "mxfp4"}
    assert {r["backend"] for r in rows} == {"reference"}
    assert data["header"]["backends"] == ["reference"]
    assert all(0 < r["bytes_floor_us"] <= r["floor_us"] for r in rows)
    # The row table: shape, T, format, backend, us, floor, %floor, %bytes, ...
    printed = [line.split() for line in stdout.splitlines()
               if line.startswith("smoke ") and line.split()[3] == "reference"]
    assert len(printed) == 6
    assert all(cells[7].endswith("%") == (cells[1] == "1") for cells in printed)
