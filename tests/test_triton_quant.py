"""The Triton experts kernels on quantized weights against the reference backend.

Legend: T tokens, H hidden size, I expert intermediate size, E experts,
K experts per token, R rows.

Without CUDA the kernels run under the Triton interpreter (fp16/fp32 only: it
mishandles bf16) at small shapes; ``gpu`` tests add bf16 at real widths, CUDA
graphs and ``torch.compile``.

Error bounds, as max |out - ref| / max |ref| (`assert_close_to`): the kernels
and ``moe_reference::experts_quant`` read the same quantized weights and, with
fp8 activations, the same fp8 hidden rows (`act_quant` rounds as torch does,
bit for bit, tested here). What is left:

- fp32 activations, every format: fp32 sums in another order (`BOUNDS` fp32);
  on a GPU, w8a8 products go through fp8 tensor cores, which sum a K tile's
  products with fewer bits than fp32 (about 14 on Hopper, as DeepSeek-V3's
  report measured; the kernels add each tile's sum in fp32): `FP8_MMA_BOUND`.
- fp16, weight-only formats (W8A16, MXFP4): the intermediate and the output are
  rounded to fp16, where the reference keeps the intermediate in fp32.
- fp16, w8a8: the kernels quantize the intermediate from its fp16 rounding, the
  reference from fp32; where that rounding crosses an fp8 rounding boundary the
  intermediate value moves by a whole fp8 step (up to 1/8 of it). A few such
  steps among I = 64 terms move an output by up to ~2% of the largest
  (`W8A8_LOW_PRECISION_BOUND`); the GPU tests bound the same effect in norm.
"""

import dataclasses

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import torch_moe_ops as tmo
from conftest import ExpertInputs, QuantInputs, make_quant_inputs, random_topk_ids
from torch_moe_ops import quant
from torch_moe_ops.backends.common import TRITON_INSTALLED
from torch_moe_ops.backends.registry import REGISTRY, Problem
from torch_moe_ops.config import BackendSpec, MoEConfig, QuantSpec

if TRITON_INSTALLED:  # otherwise every test here skips (the `triton` marker)
    from torch_moe_ops.backends.common.kernels import act_quant, grouped_gemm
    from torch_moe_ops.backends.triton import configs, fused

pytestmark = pytest.mark.triton
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gpu = pytest.mark.gpu
FORMATS = {
    "fp8_tensor": QuantSpec("fp8_tensor"),
    "fp8_channel": QuantSpec("fp8_channel"),
    # bn != bk: a scale index with rows and columns swapped shows.
    "fp8_block": QuantSpec("fp8_block", block_size=(32, 64)),
    "fp8_tensor_w8a16": QuantSpec("fp8_tensor", "none"),
    "fp8_channel_w8a16": QuantSpec("fp8_channel", "none"),
    "fp8_block_w8a16": QuantSpec("fp8_block", "none", (64, 32)),
    "mxfp4": QuantSpec("mxfp4"),
}
SIZES = {"num_tokens": 5, "hidden_size": 128, "intermediate_size": 64, "num_experts": 4,
         "top_k": 2}
# swiglu_limit=1 makes the clamps bite on O(1) pre-activations.
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 1.0
BOUNDS = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
W8A8_LOW_PRECISION_BOUND = 3e-2
FP8_MMA_BOUND = 2e-3


def bound(spec: QuantSpec, dtype: torch.dtype) -> float:
    """The max-error bound of the module docstring for ``spec`` with ``dtype`` activations."""
    if spec.activations != "none" and dtype != torch.float32:
        return W8A8_LOW_PRECISION_BOUND
    if spec.activations != "none" and DEVICE.type == "cuda":
        return FP8_MMA_BOUND
    return BOUNDS[dtype]


def assert_close_to(out: torch.Tensor, ref: torch.Tensor, limit: float) -> None:
    """max |out - ref| <= limit * max |ref| (nothing to compare for empty tensors)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if not ref.numel():
        return
    err = (out.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    assert err <= limit * scale, f"max error {err:.3e} > {limit:.1e} * max |ref| {scale:.3e}"


@pytest.fixture(params=["direct", "tiled"])
def kernel_path(request, monkeypatch):
    """Runs the test on each path's kernels, whatever a call's size would pick."""
    def pick(*key):
        config = configs.default_config(*key)
        quant_spec = key[7] if len(key) > 7 else None
        return dataclasses.replace(config, path=request.param, BLOCK_K=configs.fit_block_k(
            config.BLOCK_K, quant_spec, request.param))

    monkeypatch.setattr(fused, "get_config", pick)
    return request.param


def inputs(spec: QuantSpec, generator, **sizes):
    """`make_quant_inputs` at `SIZES` (overridden by ``sizes``), on DEVICE, with the
    last token's slots all skipped."""
    q = make_quant_inputs(generator, spec, **{**SIZES, "skip_fraction": 0.2, **sizes})
    f = q.float_inputs
    if f.topk_ids_TK.shape[0] > 1:
        f.topk_ids_TK[-1] = -1
    moved = {name: None if t is None else t.to(DEVICE)
             for name, t in vars(f).items()}
    return dataclasses.replace(
        q, float_inputs=dataclasses.replace(f, **moved), w13=q.w13.to(DEVICE),
        w2=q.w2.to(DEVICE), w13_scale=q.w13_scale.to(DEVICE), w2_scale=q.w2_scale.to(DEVICE))


def run_both(q, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    args = q.args(activation, SWIGLU_ALPHA, SWIGLU_LIMIT)
    return (torch.ops.moe_triton.experts_quant(*args),
            torch.ops.moe_reference.experts_quant(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_experts_quant(fmt, dtype, kernel_path, generator, poisoned_empty):
    spec = FORMATS[fmt]
    activation = {"fp8_channel": "gelu", "mxfp4": "swiglu_oai"}.get(fmt.split("_w8")[0], "silu")
    q = inputs(spec, generator, dtype=dtype, bias=dtype == torch.float16,
               ids_dtype=torch.int64 if dtype == torch.float16 else torch.int32)
    out, ref = run_both(q, activation)
    assert out.is_contiguous()
    assert_close_to(out, ref, bound(spec, dtype))
    assert (out[-1] == 0).all()  # every slot skipped: exact zeros


@pytest.mark.parametrize("dtype, split_k", [(torch.float32, 1), (torch.float16, 1),
                                            (torch.float32, 2)],
                         ids=["fp32-whole-k", "fp16-whole-k", "fp32-k-parts"])
@pytest.mark.parametrize("block_n", [16, 64], ids=["rows", "tensor_cores"])
def test_mxfp4_direct_routes(block_n, dtype, split_k, generator, monkeypatch, poisoned_empty):
    """The direct MXFP4 kernels meet the slot's row on the CUDA cores below
    ``MXFP4_DOT_MIN_N`` columns and in the tensor cores from there, K whole or in parts
    (H=128 and I=64 in two each with 32-deep tiles)."""
    from torch_moe_ops.backends.triton import direct_kernels
    assert (block_n >= direct_kernels.MXFP4_DOT_MIN_N.value) == (block_n == 64)

    def pick(*key):
        return dataclasses.replace(configs.default_config(*key), path="direct", BLOCK_N=block_n,
                                   BLOCK_K=32, SPLIT_K=split_k)

    monkeypatch.setattr(fused, "get_config", pick)
    q = inputs(FORMATS["mxfp4"], generator, dtype=dtype, bias=True)
    out, ref = run_both(q, "swiglu_oai")
    assert_close_to(out, ref, bound(q.spec, dtype))
    assert (out[-1] == 0).all()


# Every format at top-k 2; one expert per token (the parts' rows apart from the output) once.
@pytest.mark.parametrize("fmt, top_k", [(fmt, 2) for fmt in FORMATS] + [("mxfp4", 1)])
def test_direct_kernels_in_k_parts(fmt, top_k, generator, monkeypatch, poisoned_empty):
    """SPLIT_K=3 cuts H=320 into 128 + 128 + 64 columns and I=128 into 64 + 64: each
    format's scales are read at the part's columns, and the parts' sums make the
    reference's output."""
    def pick(*key):
        return dataclasses.replace(configs.default_config(*key), path="direct", BLOCK_K=32,
                                   SPLIT_K=3)

    monkeypatch.setattr(fused, "get_config", pick)
    spec = FORMATS[fmt]
    q = inputs(spec, generator, hidden_size=320, intermediate_size=128, top_k=top_k, bias=True)
    out, ref = run_both(q, "swiglu_oai")
    assert_close_to(out, ref, bound(spec, torch.float32))
    assert (out[-1] == 0).all()


# Each on one path: both paths run swiglu_oai in test_experts_quant.
@pytest.mark.parametrize("activation,kernel_path", [("silu", "direct"), ("gelu", "tiled")],
                         indirect=["kernel_path"])
def test_mxfp4_every_activation(activation, kernel_path, generator):
    q = inputs(FORMATS["mxfp4"], generator, bias=True)
    out, ref = run_both(q, activation)
    assert_close_to(out, ref, bound(q.spec, torch.float32))


@pytest.mark.parametrize("fmt,kernel_path", [("fp8_block", "tiled"), ("mxfp4", "direct"),
                                             ("fp8_channel_w8a16", "tiled")],
                         indirect=["kernel_path"])
def test_one_expert_per_token(fmt, kernel_path, generator, poisoned_empty):
    q = inputs(FORMATS[fmt], generator, top_k=1, bias=True)
    out, ref = run_both(q, "swiglu_oai")
    assert_close_to(out, ref, bound(q.spec, torch.float32))
    assert (out[-1] == 0).all()


@pytest.mark.parametrize("fmt", ["fp8_channel", "mxfp4"])
def test_no_tokens_launches_nothing(fmt, generator, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a kernel ran for 0 tokens")

    monkeypatch.setattr(fused, "align_rows", fail)
    monkeypatch.setattr(fused, "quantize_rows", fail)
    q = inputs(FORMATS[fmt], generator, num_tokens=0, bias=True)
    out, ref = run_both(q, "silu")
    assert out.shape == ref.shape == (0, SIZES["hidden_size"])
    f = q.float_inputs
    rows_args = (f.hidden_TH, None, f.topk_ids_TK[:, 0].to(torch.int32),
                 torch.zeros(SIZES["num_experts"], dtype=torch.int32, device=DEVICE),
                 *q.weight_args("silu"))
    assert torch.ops.moe_triton.experts_rows_quant(*rows_args).shape == (0, SIZES["hidden_size"])


@pytest.mark.parametrize("kernel_path", ["direct"], indirect=True)
def test_activations_are_quantized_once_per_token(kernel_path, generator, monkeypatch):
    """The hidden rows are quantized once per token (T rows), the intermediate once per slot."""
    seen = []

    def recording(x_MK, spec):
        seen.append(tuple(x_MK.shape))
        return act_quant.quantize_rows(x_MK, spec)

    monkeypatch.setattr(fused, "quantize_rows", recording)
    q = inputs(FORMATS["fp8_block"], generator)
    run_both(q, "silu")
    T, H, I, K = (SIZES[k] for k in ("num_tokens", "hidden_size", "intermediate_size", "top_k"))
    assert seen == [(T, H), (T * K, I)]


def rows_args(q, prequantized: bool):
    """``moe::experts_rows_quant`` arguments: the routed rows that dispatch makes
    (rows of expert -1 at the end), fp8 with scales when ``prequantized``."""
    f = q.float_inputs
    x_RH, expert_R, _, _, count_E, _ = torch.ops.moe.dispatch(
        f.hidden_TH, f.topk_weights_TK, f.topk_ids_TK, q.w13.shape[0])
    if not prequantized:
        return (x_RH, None, expert_R, count_E, *q.weight_args("swiglu_oai", SWIGLU_ALPHA,
                                                               SWIGLU_LIMIT))
    x_q_RH, x_scale = quant.quantize_activations(x_RH, q.spec)
    return (x_q_RH, x_scale, expert_R, count_E,
            *q.weight_args("swiglu_oai", SWIGLU_ALPHA, SWIGLU_LIMIT), x_RH.dtype)


@pytest.mark.parametrize("fmt,prequantized,kernel_path", [
    ("fp8_block", False, "tiled"), ("fp8_block", True, "direct"), ("fp8_channel", True, "tiled"),
    ("fp8_tensor", False, "direct"), ("mxfp4", False, "direct"), ("mxfp4", False, "tiled")],
    indirect=["kernel_path"])
def test_experts_rows_quant(fmt, prequantized, kernel_path, generator, poisoned_empty):
    q = inputs(FORMATS[fmt], generator, dtype=torch.float16, bias=True)
    args = rows_args(q, prequantized)
    out = torch.ops.moe_triton.experts_rows_quant(*args)
    ref = torch.ops.moe_reference.experts_rows_quant(*args)
    assert out.dtype == torch.float16 and out.is_contiguous()
    assert_close_to(out, ref, bound(q.spec, torch.float16))
    assert (out[args[2] < 0] == 0).all()


if TRITON_INSTALLED:
    import triton
    import triton.language as tl

    @triton.jit
    def _fp8_mismatches_kernel(x_ptr, amax_ptr, scale_ptr, count_ptr, num_scales,
                               BLOCK_S: tl.constexpr, BLOCK_X: tl.constexpr):
        # How many of this program's (group amax, x) pairs, |x| <= amax as in a group, get
        # another fp8 value from `_fp8_values` than from div_rn's quotient (NaN equal to NaN).
        scales = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
        amax = tl.load(amax_ptr + scales, mask=scales < num_scales, other=0.0)
        scale = tl.load(scale_ptr + scales, mask=scales < num_scales, other=1.0)
        x = tl.load(x_ptr + tl.program_id(1) * BLOCK_X + tl.arange(0, BLOCK_X))[None, :]
        x = x + tl.zeros((BLOCK_S, BLOCK_X), tl.float32)
        fast = act_quant._fp8_values(x, scale)
        exact = act_quant._round_to_e4m3(
            tl.clamp(tl.math.div_rn(x, scale[:, None]), -act_quant.FP8_MAX, act_quant.FP8_MAX))
        in_group = (tl.abs(x) <= amax[:, None]) & (scales < num_scales)[:, None]
        both_nan = (fast != fast) & (exact != exact)  # noqa: PLR0124 (NaN's test)
        differ = (fast != exact) & ~both_nan & in_group
        tl.store(count_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1),
                 tl.sum(tl.sum(differ.to(tl.int32), axis=1), axis=0))


@pytest.mark.parametrize("every", [
    pytest.param(1, marks=gpu, id="every-group"),
    pytest.param(2039, id="sampled-groups")])
def test_fp8_values_divide_as_div_rn(every):
    """`act_quant._fp8_values` (one division a row, `_divide_rows`) gives the fp8 values of
    div_rn's quotient: on a GPU every bf16 value (NaN and infinities too) in every group of
    bf16 values it can be in (scale ``max(amax, 1e-12) / 448`` for each bf16 amax, infinite
    included, torch's division); on the CPU every 2039th amax, and amaxes whose scale is not a
    power of two but whose quotients can be e4m3 ties (scales 1.5, 1.25 and 3)."""
    x_X = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(
        torch.bfloat16).float()
    amax_A = torch.cat([torch.arange(0, 0x7F81, every, dtype=torch.int32).to(torch.int16).view(
        torch.bfloat16).float(), torch.tensor([1.5, 1.25, 3.0]) * quant.FP8_MAX])
    scale_A = amax_A.clamp(min=quant.MIN_SCALE) / quant.FP8_MAX
    x_X, amax_A, scale_A = x_X.to(DEVICE), amax_A.to(DEVICE), scale_A.to(DEVICE)
    block_s, block_x = 16, 1024
    counts = torch.empty(triton.cdiv(scale_A.numel(), block_s), x_X.numel() // block_x,
                         dtype=torch.int32, device=DEVICE)
    _fp8_mismatches_kernel[counts.shape](x_X, amax_A, scale_A, counts, scale_A.numel(),
                                         BLOCK_S=block_s, BLOCK_X=block_x)
    assert counts.sum().item() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("spec", [QuantSpec("fp8_channel"), QuantSpec("fp8_block")],
                         ids=["fp8_token", "fp8_group"])
def test_activation_quantization_rounds_as_torch(spec, dtype, generator):
    x_MK = torch.randn((6, 384), generator=generator) * 3
    x_MK[1] = 0  # the smallest scale
    x_MK[2, :50] = torch.linspace(-448, 448, 50)  # a row whose values round up a binade
    x_MK[3] *= 1e-4  # fp8 subnormals
    x_MK = x_MK.to(DEVICE, dtype)
    q_MK, scale = act_quant.quantize_rows(x_MK, spec)
    expected_q_MK, expected_scale = quant.quantize_activations(x_MK, spec)
    assert q_MK.dtype == quant.FP8_DTYPE and scale.shape == expected_scale.shape
    assert torch.equal(scale, expected_scale)
    # Equal as values: the kernel rounds a tiny negative value to +0, torch to -0.
    assert torch.equal(q_MK.float(), expected_q_MK.float())


@pytest.mark.parametrize("spec", [QuantSpec("fp8_channel"), QuantSpec("fp8_block")],
                         ids=["fp8_token", "fp8_group"])
def test_quantize_rows_writes_each_row_to_its_targets(spec, generator, poisoned_empty):
    """With a table of targets each row's fp8 values and scales land, as they are, on each
    of its rows (-1: none); rows no target names stay unwritten (NaN here)."""
    x_MK = (torch.randn((5, 384), generator=generator) * 3).to(DEVICE)
    targets_MS = torch.tensor([[7, 0], [-1, 2], [4, -1], [-1, -1], [1, 9]], dtype=torch.int32,
                              device=DEVICE)
    q_NK, scale = act_quant.quantize_rows(x_MK, spec, targets_MS, num_out=11)
    expected_q_MK, expected_scale = act_quant.quantize_rows(x_MK, spec)
    assert q_NK.shape == (11, 384) and scale.shape == (11, *expected_scale.shape[1:])
    for row, outs in enumerate(targets_MS.tolist()):
        for out in outs:
            if out >= 0:
                assert torch.equal(q_NK[out].float(), expected_q_MK[row].float())
                assert torch.equal(scale[out], expected_scale[row])
    written = targets_MS[targets_MS >= 0].long()
    unwritten = torch.ones(11, dtype=torch.bool, device=DEVICE).index_fill_(0, written, False)
    assert q_NK[unwritten].float().isnan().all() and scale[unwritten].isnan().all()


def scale_layouts(num_rows: int, groups: int) -> dict:
    """Scale buffers of ``num_rows`` rows other than row-major ``[M, G]`` (NaN under
    `poisoned_empty`): M-major with columns padded to a multiple of 4 rows (DeepGEMM's
    contiguous GEMM's), the same in blocks of 4 rows ``[B, 4, G]`` (its masked GEMM's), and
    row-major blocks."""
    padded = -(-num_rows // 4) * 4
    return {
        "m_major": torch.empty((groups, padded), device=DEVICE).T[:num_rows],
        "m_major_blocks": torch.empty((num_rows // 4, groups, 4), device=DEVICE).transpose(1, 2),
        "row_major_blocks": torch.empty((num_rows // 4, 4, groups), device=DEVICE),
    }


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (fp8 as floats) and NaN in the same places."""
    a, b = a.float(), b.float()
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0), b.nan_to_num(0))


@pytest.mark.parametrize("layout", ["m_major", "m_major_blocks", "row_major_blocks"])
def test_quantize_rows_writes_scales_where_scale_out_says(layout, generator, poisoned_empty):
    """Given a scale buffer of any strides, ``[N, G]`` or ``[B, N / B, G]``, each written row's
    scales land there (row n of block n // (N / B)), the values those of the row-major call;
    rows no target names stay unwritten (NaN here)."""
    spec = QuantSpec("fp8_block")
    x_MK = (torch.randn((5, 384), generator=generator) * 3).to(DEVICE)
    targets_MS = torch.tensor([[7, 0], [-1, 2], [4, -1], [-1, -1], [1, 9]], dtype=torch.int32,
                              device=DEVICE)
    scale_out = scale_layouts(12, 3)[layout]
    q_NK, scale = act_quant.quantize_rows(x_MK, spec, targets_MS, num_out=12,
                                          scale_out=scale_out)
    expected_q_NK, expected_scale_NG = act_quant.quantize_rows(x_MK, spec, targets_MS,
                                                               num_out=12)
    assert scale is scale_out
    assert same(q_NK, expected_q_NK)
    scale_NG = scale.reshape(12, 3)
    assert same(scale_NG, expected_scale_NG)
    assert scale_NG.isnan().sum() == 6 * 3  # rows 3, 5, 6, 8, 10, 11
    if layout == "m_major":
        assert scale.stride() == (1, 12)


@pytest.mark.parametrize("layout", ["m_major", "m_major_blocks", "row_major_blocks"])
def test_bias_act_quantize_rows_writes_scales_where_scale_out_says(layout, generator,
                                                                   poisoned_empty):
    """As `quantize_rows`: the scales of the rows of expert -1 stay unwritten."""
    spec = QuantSpec("fp8_block")
    h_MF, b13_EF, expert_M = activation_rows(generator, 40, 256, torch.float32, bias=True)
    scale_out = scale_layouts(40, 2)[layout]
    q_MI, scale = act_quant.bias_act_quantize_rows(h_MF, b13_EF, expert_M, "silu",
                                                   SWIGLU_ALPHA, SWIGLU_LIMIT, spec, scale_out)
    expected_q_MI, expected_scale_MG = act_quant.bias_act_quantize_rows(
        h_MF, b13_EF, expert_M, "silu", SWIGLU_ALPHA, SWIGLU_LIMIT, spec)
    assert scale is scale_out
    assert same(q_MI, expected_q_MI)
    scale_MG = scale.reshape(40, 2)
    assert same(scale_MG, expected_scale_MG)
    assert scale_MG[expert_M < 0].isnan().all() and not scale_MG[expert_M >= 0].isnan().any()


def test_scale_out_of_another_shape_is_an_error():
    x_MK = torch.zeros((4, 256), device=DEVICE)
    with pytest.raises(ValueError, match=r"scale_out must be float32 \[4, 2\] or \[B, 4 / B, "
                                         r"2\] on .*, got torch.float32 \[4, 3\]"):
        act_quant.quantize_rows(x_MK, QuantSpec("fp8_block"),
                                scale_out=torch.empty((4, 3), device=DEVICE))


# The activation's input in the dtypes the interpreter handles (it mishandles bf16); bf16,
# what DeepGEMM writes, on a GPU.
ACT_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda"
                                               else [])


def two_pass_activation_quant(h_MF, b13_EF, expert_M, activation, spec):
    """What `act_quant.bias_act_quantize_rows` replaces: the activation written out in
    ``h``'s dtype (`epilogues.bias_act_rows`), then `act_quant.quantize_rows`."""
    a_MI = grouped_gemm.bias_act_rows(h_MF, b13_EF, expert_M, activation, SWIGLU_ALPHA,
                                      SWIGLU_LIMIT)
    return act_quant.quantize_rows(a_MI, spec)


def activation_rows(generator, num_rows, inter_size, dtype, bias):
    """``(h_MF, b13_EF, expert_M)`` of 3 experts: rows of expert -1 between and after the
    groups (a program's whole block of rows among them), a zero row, an outlier row."""
    h_MF = torch.randn((num_rows, 2 * inter_size), generator=generator) * 2
    h_MF[3] = 0  # with no bias: the smallest scale, all values 0
    h_MF[5, 7] = 300.0  # one group's scale set by one value
    b13_EF = torch.randn((3, 2 * inter_size), generator=generator) if bias else None
    expert_M = torch.randint(0, 3, (num_rows,), generator=generator, dtype=torch.int32)
    expert_M[1] = -1
    expert_M[16:32] = -1  # every row of a program (8 rows a program for 128-column groups)
    expert_M[-3:] = -1
    moved = (t if t is None else t.to(DEVICE) for t in (h_MF, b13_EF, expert_M))
    h_MF, b13_EF, expert_M = moved
    return h_MF.to(dtype), None if b13_EF is None else b13_EF.to(dtype), expert_M


@pytest.mark.parametrize("dtype", ACT_DTYPES, ids=str)
@pytest.mark.parametrize("activation", ["silu", "gelu", "swiglu_oai"])
@pytest.mark.parametrize("spec,bias", [(QuantSpec("fp8_block"), False),
                                       (QuantSpec("fp8_block", block_size=(64, 64)), True),
                                       (QuantSpec("fp8_channel"), True)],
                         ids=["fp8_group128", "fp8_group64_bias", "fp8_token_bias"])
def test_bias_act_quantize_rows_is_the_two_passes(spec, bias, activation, dtype, generator,
                                                  poisoned_empty):
    """One pass gives what the activation and then the quantizer gave, bit for bit, on the
    rows that carry a token, and leaves the rows of expert -1 unwritten (NaN here)."""
    h_MF, b13_EF, expert_M = activation_rows(generator, 40, 256, dtype, bias)
    q_MI, scale = act_quant.bias_act_quantize_rows(h_MF, b13_EF, expert_M, activation,
                                                   SWIGLU_ALPHA, SWIGLU_LIMIT, spec)
    expected_q_MI, expected_scale = two_pass_activation_quant(h_MF, b13_EF, expert_M,
                                                              activation, spec)
    assert q_MI.dtype == quant.FP8_DTYPE and q_MI.shape == expected_q_MI.shape
    assert scale.dtype == torch.float32 and scale.shape == expected_scale.shape
    kept_M = expert_M >= 0
    assert torch.equal(scale[kept_M], expected_scale[kept_M])
    # Equal as values: a tiny negative value may round to +0 or -0.
    assert torch.equal(q_MI[kept_M].float(), expected_q_MI[kept_M].float())
    assert q_MI[~kept_M].float().isnan().all() and scale[~kept_M].isnan().all()
    if not bias:
        assert (q_MI[3].float() == 0).all() and (scale[3] == quant.MIN_SCALE / quant.FP8_MAX).all()


@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
def test_bias_act_quantize_rows_is_the_reference_quantizer(activation, generator):
    """Against the plain-torch composition (`activation` in fp32, then
    `quant.quantize_activations`) on fp32 input, where no rounding comes between them."""
    from torch_moe_ops.backends.common.kernels.activation import activation as act

    spec = QuantSpec("fp8_block")
    h_MF, _, expert_M = activation_rows(generator, 24, 256, torch.float32, bias=False)
    q_MI, scale_MG = act_quant.bias_act_quantize_rows(h_MF, None, expert_M, activation,
                                                      SWIGLU_ALPHA, SWIGLU_LIMIT, spec)
    kept_M = expert_M >= 0
    a_MI = act(h_MF[kept_M, :256], h_MF[kept_M, 256:], activation, SWIGLU_ALPHA, SWIGLU_LIMIT)
    expected_q_MI, expected_scale_MG = quant.quantize_activations(a_MI, spec)
    torch.testing.assert_close(scale_MG[kept_M], expected_scale_MG, rtol=1e-6, atol=0)
    # The activation's last bit may differ (Triton's sigmoid, torch's silu): an fp8 step
    # at most where it crosses a rounding boundary.
    steps = (q_MI[kept_M].float() - expected_q_MI.float()).abs()
    assert (steps <= expected_q_MI.float().abs() / 8 + 2**-9).all()


def test_bias_act_quantize_rows_needs_whole_groups():
    h_MF = torch.zeros((4, 2 * 192), device=DEVICE)
    with pytest.raises(ValueError, match="needs I divisible by the scale group, got I=192, "
                                         "group=128"):
        act_quant.bias_act_quantize_rows(h_MF, None, torch.zeros(4, dtype=torch.int32,
                                                                 device=DEVICE),
                                         "silu", SWIGLU_ALPHA, SWIGLU_LIMIT,
                                         QuantSpec("fp8_block"))


def test_bias_act_quantize_rows_of_no_rows():
    q_MI, scale_MG = act_quant.bias_act_quantize_rows(
        torch.zeros((0, 512), device=DEVICE), None, torch.zeros(0, dtype=torch.int32,
                                                                device=DEVICE),
        "silu", SWIGLU_ALPHA, SWIGLU_LIMIT, QuantSpec("fp8_block"))
    assert q_MI.shape == (0, 256) and scale_MG.shape == (0, 2)


@gpu
@pytest.mark.parametrize("activation,bias", [("silu", False), ("gelu", False),
                                             ("swiglu_oai", True)])
@pytest.mark.parametrize("inter_size", [768, 1024, 2048],
                         ids=["qwen3_30b_a3b", "olmoe", "deepseek_v3"])
def test_bias_act_quantize_rows_is_the_two_passes_gpu(inter_size, activation, bias):
    """bf16 GEMM output at real widths, in DeepGEMM's contiguous layout (64 experts, groups
    padded to 128 rows, the layout's all-padding tail): one pass is the two, bit for bit."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.randint(0, 400, (64,), generator=generator, device="cuda")
    padded = (counts + 127) // 128 * 128
    num_rows = int(padded.sum()) + 64 * 128
    expert_M = torch.full((num_rows,), -1, dtype=torch.int32, device="cuda")
    start = 0
    for expert, (count, size) in enumerate(zip(counts.tolist(), padded.tolist())):
        expert_M[start:start + count] = expert
        start += size
    h_MF = torch.randn((num_rows, 2 * inter_size), generator=generator, device="cuda",
                       dtype=torch.bfloat16) * 4
    b13_EF = (torch.randn((64, 2 * inter_size), generator=generator, device="cuda",
                          dtype=torch.bfloat16) if bias else None)
    spec = QuantSpec("fp8_block")
    q_MI, scale_MG = act_quant.bias_act_quantize_rows(h_MF, b13_EF, expert_M, activation,
                                                      SWIGLU_ALPHA, SWIGLU_LIMIT, spec)
    expected_q_MI, expected_scale_MG = two_pass_activation_quant(h_MF, b13_EF, expert_M,
                                                                 activation, spec)
    kept_M = expert_M >= 0
    assert torch.equal(scale_MG[kept_M], expected_scale_MG[kept_M])
    assert torch.equal(q_MI[kept_M].float(), expected_q_MI[kept_M].float())


def test_config_files_are_keyed_by_format():
    spec = QuantSpec("fp8_block")
    assert (configs.config_file_name(256, 2048, 7168, torch.bfloat16, "X", spec)
            == "E=256,N=2048,K=7168,dtype=bfloat16,quant=fp8_block128x128+fp8_group,"
               "device=X.json")
    assert (configs.config_file_name(8, 64, 128, torch.bfloat16, "X")
            == "E=8,N=64,K=128,dtype=bfloat16,device=X.json")


@pytest.mark.parametrize("spec", list(FORMATS.values()), ids=list(FORMATS))
@pytest.mark.parametrize("device_name", ["cpu", "NVIDIA_H100_80GB_HBM3"])
def test_default_configs_suit_each_format(spec, device_name):
    for M in (1, 16, 4096, 100_000):
        config = configs.get_config(8, 256, 512, torch.bfloat16, M, 4, device_name, spec)
        assert config.path != "grouped_mm"
        assert configs.fits_format(config, spec), config
    w8a8 = configs.default_config(8, 256, 512, torch.bfloat16, 4096, 4, device_name,
                                  QuantSpec("fp8_channel"))
    assert w8a8.BLOCK_K >= 32


def test_tuned_entry_that_does_not_suit_its_format_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    configs._tuned_entries.cache_clear()
    configs.get_config.cache_clear()
    spec = QuantSpec("fp8_block", block_size=(128, 64))
    entry = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4,
             "num_stages": 3, "path": "tiled"}
    (tmp_path / configs.config_file_name(8, 128, 256, torch.float16, "X", spec)).write_text(
        '{"1": ' + str(entry).replace("'", '"') + "}")
    try:
        with pytest.raises(ValueError, match="BLOCK_K=128.*divisor of 64"):
            configs.get_config(8, 128, 256, torch.float16, 1, 2, "X", spec)
        configs._tuned_entries.cache_clear()
        # w8a8's direct kernels multiply on the tensor cores: 16 columns at least.
        narrow = {**entry, "BLOCK_K": 64, "BLOCK_N": 8, "path": "direct"}
        (tmp_path / configs.config_file_name(8, 128, 256, torch.float16, "X", spec)).write_text(
            '{"1": ' + str(narrow).replace("'", '"') + "}")
        with pytest.raises(ValueError, match="BLOCK_N=8.*BLOCK_N at least 16"):
            configs.get_config(8, 128, 256, torch.float16, 2, 2, "X", spec)
    finally:
        configs._tuned_entries.cache_clear()
        configs.get_config.cache_clear()


@pytest.mark.parametrize("spec,reason", [
    (QuantSpec("fp8_block", block_size=(128, 16)), "divisible by 32"),
    (QuantSpec("fp8_block", "none", (128, 8)), "divisible by 16"),
    (QuantSpec("fp8_block", "none", (128, 16)), None),
    (QuantSpec("mxfp4"), None),
])
def test_supports_says_which_formats_run(spec, reason):
    backend = REGISTRY.experts["triton"]
    got = backend.why_not(BackendSpec(experts="triton"), Problem(torch.float16, quant=spec),
                          DEVICE)
    if reason is None:
        assert got is None
    else:
        assert reason in got


def test_quantized_prefill_takes_the_tiled_kernels():
    mxfp4, fp8 = QuantSpec("mxfp4"), QuantSpec("fp8_channel", "none")
    many = configs.GROUPED_MM_MIN_ROWS_PER_EXPERT * 8 // 4
    # MXFP4 too: no decoded copy of the layer (the tiled kernels read fragments).
    assert configs.default_path(8, many, 4, mxfp4) == "tiled"
    assert configs.default_path(8, many - 1, 4, mxfp4) == "tiled"
    assert configs.default_path(8, many, 4, fp8) == "tiled"
    assert configs.default_path(8, many, 4) == "grouped_mm"
    # One token: the direct kernels, but w8a8 multiplies on the tensor cores (tiled).
    assert configs.default_path(8, 1, 4, mxfp4) == configs.default_path(8, 1, 4, fp8) == "direct"
    assert configs.default_path(8, 1, 4, QuantSpec("fp8_channel")) == "direct"
    assert configs.default_path(64, 8, 4, QuantSpec("fp8_channel")) == "tiled"
    x_TH = torch.empty((many, 128), dtype=torch.bfloat16, device=DEVICE)
    ids_TK = torch.zeros((many, 4), dtype=torch.int32, device=DEVICE)
    w13 = torch.empty((8, 128, 64), dtype=torch.uint8, device=DEVICE)
    assert fused._plan(x_TH, ids_TK, w13, mxfp4).path == "tiled"
    assert fused._plan(x_TH.half(), ids_TK, w13, mxfp4).path == "tiled"


# GPU: bf16 at real widths, CUDA graphs, torch.compile. Norm bounds: the output's
# relative error in norm, ||out - ref|| / ||ref||, over bf16 rounding (weight-only)
# and the fp8 steps of the intermediate's rounding through bf16 (w8a8).
GPU_NORM_BOUNDS = {"none": 1e-2, "fp8": 3e-2}


def assert_norm_close(out: torch.Tensor, ref: torch.Tensor, spec: QuantSpec) -> None:
    limit = GPU_NORM_BOUNDS["none" if spec.activations == "none" else "fp8"]
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err <= limit, f"relative error {err:.3e} > {limit:.0e} ({spec.name})"


def gpu_inputs(spec: QuantSpec, num_tokens: int, hidden_size: int, intermediate_size: int,
               num_experts: int, top_k: int, bias: bool = False, seed: int = 0) -> QuantInputs:
    """`QuantInputs` made and quantized on the GPU (real widths take seconds on the
    CPU): bf16 activations, a fifth of the slots and the last token skipped."""
    T, H, I, E, K = num_tokens, hidden_size, intermediate_size, num_experts, top_k
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(shape, generator=g, device="cuda") * scale

    ids_TK = random_topk_ids(T, E, K, torch.Generator().manual_seed(seed), skip_fraction=0.2)
    if T > 1:
        ids_TK[-1] = -1
    f = ExpertInputs(
        hidden_TH=randn(T, H).bfloat16(),
        topk_weights_TK=torch.rand((T, K), generator=g, device="cuda"),
        topk_ids_TK=ids_TK.cuda(), w13_EFH=randn(E, 2 * I, H, scale=H ** -0.5),
        w2_EHI=randn(E, H, I, scale=I ** -0.5),
        b13_EF=randn(E, 2 * I, scale=0.5).bfloat16() if bias else None,
        b2_EH=randn(E, H, scale=0.5).bfloat16() if bias else None)
    (w13, w13_scale), (w2, w2_scale) = (quant.quantize_weights(w, spec)
                                        for w in (f.w13_EFH, f.w2_EHI))
    return QuantInputs(spec, f, w13, w2, w13_scale, w2_scale)


@gpu
@pytest.mark.parametrize("T", [1, 4, 256])
def test_deepseek_v3_fp8_block_gpu(T, kernel_path):
    q = gpu_inputs(QuantSpec("fp8_block"), num_tokens=T, hidden_size=7168,
                   intermediate_size=2048, num_experts=16, top_k=8)
    out, ref = run_both(q, "silu")
    assert_norm_close(out, ref, q.spec)


@gpu
@pytest.mark.parametrize("T", [1, 7, 333])
def test_gpt_oss_mxfp4_gpu(T, kernel_path):
    q = gpu_inputs(QuantSpec("mxfp4"), num_tokens=T, hidden_size=2880,
                   intermediate_size=2880, num_experts=8, top_k=4, bias=True)
    out, ref = run_both(q, "swiglu_oai")
    assert_norm_close(out, ref, q.spec)


@gpu
def test_gpt_oss_mxfp4_prefill_gpu():
    q = gpu_inputs(QuantSpec("mxfp4"), num_tokens=2048, hidden_size=2880,
                   intermediate_size=2880, num_experts=8, top_k=4, bias=True)
    f = q.float_inputs
    assert fused._plan(f.hidden_TH, f.topk_ids_TK, q.w13, q.spec).path == "tiled"
    out, ref = run_both(q, "swiglu_oai")
    assert_norm_close(out, ref, q.spec)
    args = rows_args(q, prequantized=False)
    assert_norm_close(torch.ops.moe_triton.experts_rows_quant(*args),
                      torch.ops.moe_reference.experts_rows_quant(*args), q.spec)


@gpu
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("T", [3, 600])
def test_every_format_gpu(fmt, T, kernel_path):
    q = gpu_inputs(FORMATS[fmt], num_tokens=T, hidden_size=1024,
                   intermediate_size=512, num_experts=16, top_k=4, bias=True)
    out, ref = run_both(q, "swiglu_oai")
    assert_norm_close(out, ref, q.spec)
    args = rows_args(q, prequantized=q.spec.activations != "none")
    assert_norm_close(torch.ops.moe_triton.experts_rows_quant(*args),
                      torch.ops.moe_reference.experts_rows_quant(*args), q.spec)


@gpu
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("T", [1, 3])
def test_direct_kernels_in_k_parts_gpu(fmt, T, monkeypatch):
    spec = FORMATS[fmt]

    def pick(*key):
        config = configs.default_config(*key)
        return dataclasses.replace(config, path="direct", SPLIT_K=4, BLOCK_K=configs.fit_block_k(
            128, spec, "direct"))

    monkeypatch.setattr(fused, "get_config", pick)
    q = gpu_inputs(spec, num_tokens=T, hidden_size=1024, intermediate_size=512,
                   num_experts=16, top_k=4, bias=True)
    out, ref = run_both(q, "swiglu_oai")
    assert_norm_close(out, ref, q.spec)


@gpu
@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_channel", "mxfp4"])
def test_cuda_graph_capture_and_replay(fmt, kernel_path):
    q = gpu_inputs(FORMATS[fmt], num_tokens=64, hidden_size=1024,
                   intermediate_size=512, num_experts=16, top_k=4, bias=True)
    args = q.args("swiglu_oai", SWIGLU_ALPHA, SWIGLU_LIMIT)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.ops.moe_triton.experts_quant(*args)  # compiles the kernels, caches the config
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.moe_triton.experts_quant(*args)
    fresh = gpu_inputs(FORMATS[fmt], num_tokens=64, hidden_size=1024, intermediate_size=512,
                       num_experts=16, top_k=4, seed=7)
    f, g = q.float_inputs, fresh.float_inputs
    for mine, new in ((f.hidden_TH, g.hidden_TH), (f.topk_weights_TK, g.topk_weights_TK),
                      (f.topk_ids_TK, g.topk_ids_TK)):
        mine.copy_(new)
    graph.replay()
    torch.testing.assert_close(out, torch.ops.moe_triton.experts_quant(*args), atol=0, rtol=0)
    assert_norm_close(out, torch.ops.moe_reference.experts_quant(*args), q.spec)


@gpu
@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_channel"])
def test_compiled_direct_kernels_in_k_parts_match_eager(fmt, monkeypatch):
    """fp8 layers' experts are traced into the compiled graph on CUDA (MXFP4's stay one
    node): a direct config with K in parts, launched from Inductor's code, gives the
    eager op's result."""
    spec = QuantSpec(fmt)

    def pick(*key):
        config = configs.default_config(*key)
        return dataclasses.replace(config, path="direct", SPLIT_K=4, BLOCK_K=128)

    monkeypatch.setattr(fused, "get_config", pick)
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=1024, intermediate_size=512, num_experts=16, top_k=4,
                    quant=spec)
    moe = tmo.MoE(cfg, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(moe, fullgraph=True, backend=tmo.backend(experts="triton"))
    with torch.no_grad():
        for T in (1, 5):
            x = torch.randn(T, 1024, device="cuda", dtype=torch.bfloat16)
            out, codes = run_and_get_code(compiled, x)
            assert "moe_direct_activate_kernel" in "\n".join(codes)
            torch.testing.assert_close(out, moe(x), atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.parametrize("spec", [QuantSpec("fp8_block"), QuantSpec("mxfp4")],
                         ids=["fp8_block", "mxfp4"])
def test_compiled_quantized_moe_matches_eager(spec):
    torch.manual_seed(0)
    activation = "swiglu_oai" if spec.weights == "mxfp4" else "silu"
    cfg = MoEConfig(hidden_size=1024, intermediate_size=512, num_experts=16, top_k=4,
                    activation=activation, expert_bias=spec.weights == "mxfp4", quant=spec)
    moe = tmo.MoE(cfg, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(moe, fullgraph=True, backend=tmo.backend(experts="triton"))
    with torch.no_grad():
        for T in (5, 64):
            x = torch.randn(T, 1024, device="cuda", dtype=torch.bfloat16)
            expected = moe(x)
            torch.testing.assert_close(compiled(x), expected, atol=2e-2, rtol=2e-2)
