"""benchmarks/peer_triton_kernels.py: OpenAI's triton_kernels (``matmul_ogs``) as a peer of
bench_experts.py. On the CPU: its flag, its reasons (other formats, no folder: no rows),
our mxfp4 weights converted to its Hopper layouts and read back through triton_kernels'
own unswizzling and upcast, and its routing under the Triton interpreter. On an sm90 GPU:
the whole peer, graph-captured, against the reference. Tests that read triton_kernels skip
without its folder (``.peers/triton_kernels``, git-ignored), as in CI; ``matmul_ogs``
itself runs on a GPU only (its Hopper layouts are read with inline PTX).

Legend: T tokens, K experts per token, S = T * K routed slots, E experts, H hidden size,
I expert intermediate size, F = 2 * I; one expert matrix has N output rows and C input
columns, P = C / 2 packed bytes and G = C / 32 scale groups a row.
"""

from __future__ import annotations

import json

import pytest
import torch

from torch_moe_ops import quant
from torch_moe_ops.config import QuantSpec

pytestmark = pytest.mark.usefixtures("benchmarks_importable")
# Triton kernels run on the GPU where there is one, else under the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MXFP4 = QuantSpec("mxfp4")
# Widths whose rows and groups fill no whole tile of the Hopper layouts: H = 320 has
# 10 scale groups (padded to 12), I = 224 packs into 112 bytes (the value layout pads to
# 128) and w13's F = 448 rows fill no 256-row scale tile.
ODD_WIDTHS = dict(num_experts=2, top_k=2, hidden=320, inter=224)




@pytest.fixture
def peer():
    import peer_triton_kernels

    return peer_triton_kernels


@pytest.fixture
def peer_source(peer):
    """The peer, skipping the test where its folder lacks a file it needs."""
    missing = peer.missing_file()
    if missing is not None:
        pytest.skip(f"no {missing} under {peer.source_root()} "
                    "(benchmarks/peer_triton_kernels.py says how to fill it)")
    return peer


def oai_shape(**widths):
    from bench_experts import Shape

    return Shape(**widths, activation="swiglu_oai", bias=True)


def test_peers_flag_names_triton_kernels(tmp_path):
    import bench_experts

    with pytest.raises(SystemExit, match=r"--peers must be comma-separated names from hf, "
                                         r"vllm, triton_kernels, got 'vllm,triton-kernels'"):
        bench_experts.main(["--smoke", "--out", str(tmp_path), "--peers", "vllm,triton-kernels"])


def test_without_its_folder_the_peer_gives_no_rows_and_says_why(tmp_path, monkeypatch, peer):
    import bench_experts

    monkeypatch.setenv("TMO_TRITON_KERNELS_SRC", str(tmp_path / "absent"))
    bench_experts.main(["--smoke", "--out", str(tmp_path), "--shapes", "smoke-oai",
                        "--formats", "mxfp4", "--tokens", "1", "--backends", "reference",
                        "--peers", "vllm,triton_kernels"])
    with open(tmp_path / "experts.json") as f:
        data = json.load(f)
    assert [r["backend"] for r in data["rows"]] == ["reference"]
    reasons = [s["reason"] for s in data["header"]["skipped"] if s["backend"] == peer.NAME]
    assert len(reasons) == 1 and reasons[0].startswith(
        f"no {peer.PACKAGE_FILES[0]} under {tmp_path / 'absent'}"), reasons
    assert data["header"]["triton_kernels"] is None


@pytest.mark.parametrize("spec", [None, QuantSpec("fp8_block"), QuantSpec("fp8_channel")])
def test_runs_mxfp4_only(peer, spec):
    reason = peer.why_not(oai_shape(**ODD_WIDTHS), spec, torch.device("cpu"))
    assert reason.startswith("triton_kernels' matmul_ogs runs here for mxfp4 weights only")


def test_runs_swiglu_oai_on_hopper_only(peer_source):
    from bench_experts import Shape

    silu = Shape(8, 2, 256, 128)
    assert "swiglu_oai only" in peer_source.why_not(silu, MXFP4, torch.device("cpu"))
    assert "needs an sm90 GPU" in peer_source.why_not(oai_shape(**ODD_WIDTHS), MXFP4,
                                                       torch.device("cpu"))


def read_back(w_ECN, precision) -> torch.Tensor:
    """``[E, N, C]`` fp32: a converted matrix unswizzled by its own layouts and upcast by
    triton_kernels' torch reference (its reading of e2m1 and e8m0)."""
    from triton_kernels.numerics_details.mxfp import upcast_from_mxfp_torch

    values_EPN = w_ECN.storage.layout.unswizzle_data(w_ECN.storage.data)
    scale = precision.weight_scale
    scale_EGN = scale.storage.layout.unswizzle_data(scale.storage.data)
    C, N = w_ECN.shape[1:]
    # The scale layouts pad G and N: read the groups and columns the matrix has.
    return upcast_from_mxfp_torch(values_EPN, scale_EGN[:, :C // 32, :N], torch.float32,
                                  axis=1).mT


def test_converted_weights_read_back_as_ours(peer_source):
    """The conversion's interleaving, transposes and padding, on the CPU: what triton_kernels
    reads from the converted weights is our dequantized weights, bit for bit, with w13's
    gate rows at even and up rows at odd positions (biases likewise, in fp32)."""
    from bench_experts import make_weights
    from weight_formats import expert_weights

    shape = oai_shape(**ODD_WIDTHS)
    I = shape.inter
    stored = expert_weights("mxfp4", *make_weights(shape, torch.Generator().manual_seed(0),
                                                   torch.float32))
    converted = peer_source.kernel_weights(stored)
    E, H = shape.num_experts, shape.hidden
    assert converted.w13_EHF.shape == [E, H, 2 * I] and converted.w2_EIH.shape == [E, I, H]
    scale = converted.w13_precision.weight_scale
    groups = scale.storage.layout.unswizzle_data(scale.storage.data).shape[1]
    assert groups % peer_source.SCALE_GROUP_MULTIPLE == 0 and groups > H // 32
    w13_EFH = quant.dequantize_weights(stored.w13, stored.w13_scale, MXFP4)
    read13_EFH = read_back(converted.w13_EHF, converted.w13_precision)
    assert torch.equal(read13_EFH[:, 0::2], w13_EFH[:, :I])
    assert torch.equal(read13_EFH[:, 1::2], w13_EFH[:, I:])
    assert torch.equal(read_back(converted.w2_EIH, converted.w2_precision),
                       quant.dequantize_weights(stored.w2, stored.w2_scale, MXFP4))
    assert converted.b13_EF.dtype == torch.float32
    assert torch.equal(converted.b13_EF[:, 0::2], stored.b13_EF[:, :I])
    assert torch.equal(converted.b13_EF[:, 1::2], stored.b13_EF[:, I:])
    assert torch.equal(converted.b2_EH, stored.b2_EH)


@pytest.mark.triton
def test_routing_sorts_slots_by_expert(peer_source):
    """vLLM's bitmatrix kernel and triton_kernels' routing (40 tokens:
    more than one 32-row block of the histogram; 40 experts: two bitmatrix words): slots
    grouped by expert, each expert's count, the weights in that order, and the inverse
    order the combine scatters by."""
    generator = torch.Generator().manual_seed(0)
    T, K, E = 40, 4, 40
    ids_TK = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)])
    weights_TK = torch.rand(T, K, generator=generator)
    data, gather, scatter = peer_source.routing_data(ids_TK.to(DEVICE, torch.int32),
                                                     weights_TK.to(DEVICE), E)
    order_S = gather.src_indx.long().cpu()
    assert torch.equal(order_S.sort().values, torch.arange(T * K))
    experts_S = ids_TK.view(-1)[order_S]
    assert torch.equal(experts_S, experts_S.sort().values)
    assert torch.equal(data.expt_hist.cpu(), torch.bincount(ids_TK.view(-1), minlength=E).int())
    assert torch.equal(data.gate_scal.cpu(), weights_TK.bfloat16().view(-1)[order_S])
    assert torch.equal(gather.dst_indx.long().cpu()[order_S], torch.arange(T * K))
    assert torch.equal(scatter.src_indx, gather.dst_indx)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 300])
def test_peer_matches_the_reference_on_the_gpu(peer_source, num_tokens):
    """The whole peer, captured in a CUDA graph as the bench runs it (at 1 and 16 tokens
    its 16-row tiles, at 300 its 128-row ones), against the quantized reference on the
    same mxfp4 weights. It differs by its bf16 intermediate and routing weights (about 1%,
    by their rounding; 3% allowed); a wrong layout or gate/up order differs by the whole
    output."""
    from bench_experts import SWIGLU_ALPHA, SWIGLU_LIMIT, graph_timer, make_problem, make_weights
    from weight_formats import expert_weights

    shape = oai_shape(num_experts=16, top_k=4, hidden=512, inter=256)
    reason = peer_source.why_not(shape, MXFP4, torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    generator = torch.Generator(device="cuda").manual_seed(num_tokens)
    weights = make_weights(shape, generator)
    hidden_TH, weights_TK, ids_TK, *_ = make_problem(shape, num_tokens, weights, generator)
    stored = expert_weights("mxfp4", *weights)
    run = peer_source.triton_kernels_run((hidden_TH, weights_TK, ids_TK),
                                         peer_source.kernel_weights(stored),
                                         (SWIGLU_ALPHA, SWIGLU_LIMIT))
    replay, peer_TH = graph_timer(run)
    peer_TH.fill_(float("nan"))
    replay()
    static = ("swiglu_oai", SWIGLU_ALPHA, SWIGLU_LIMIT)
    reference_TH = torch.ops.moe_reference.experts_quant(hidden_TH, weights_TK, ids_TK,
                                                         *stored.op_args(), *static)
    assert peer_TH.shape == hidden_TH.shape
    error = (peer_TH.float() - reference_TH.float()).norm() / reference_TH.float().norm()
    assert error.item() < 0.03
