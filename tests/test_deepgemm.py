"""The ``deepgemm`` experts backend (`backends.deepgemm`): DeepGEMM's fp8 grouped GEMMs with
128 x 128 weight blocks.

Legend: T tokens, H hidden size, I expert intermediate size, E experts, K experts per token,
R rows, M rows of the contiguous layout, A its group alignment, C rows per expert of the
masked format, G scale groups per row.

On the CPU: what `supports` says of every format, device, dtype and size; the contiguous
layout's invariants; the three ops against the reference (every activation) under the Triton
interpreter with DeepGEMM's two GEMMs replaced by `contiguous_stand_in` and `masked_stand_in`,
which check what DeepGEMM asserts (dtypes, K-major operands, scale shapes, groups starting at
multiples of A), that the activation scales come in the layout DeepGEMM reads without first
transposing them (`deepgemm_transposes`), and do what it does to the rows it does not compute
(left unwritten: NaN here); buffers start as NaN (`poisoned_empty`), so a padding row that no
pass writes and that reached a real row would show. The stand-ins write fp32 where DeepGEMM
writes bf16 (the interpreter mishandles bf16). The fused activation and quantization kernel
itself is tested against the two passes it replaces in tests/test_triton_quant.py.

On an sm90 GPU with DeepGEMM built (``gpu`` marker; `scripts/build_deepgemm.sh`): the ops
against the reference in bf16 at DeepSeek-V3's 128 x 128 blocks, with -1 ids, empty experts
and 0, 1 and many tokens, and with every activation; the masked format with fp8 blocks as
DeepEP delivers them; every GEMM call's activation scales in the layout DeepGEMM reads as
they are; CUDA graph capture; a quantized `tmo.MoE` compiled with
``backend(experts="deepgemm")``.
Bounds as in tests/test_grouped_mm_quant.py (the reference reads the same fp8 weights and
rounds each GEMM's input through fp8 too).
"""

from __future__ import annotations

import math

import pytest
import torch

import torch_moe_ops as tmo
from conftest import FP8_CPU_OPCHECK_UTILS, why_not_after
from torch_moe_ops import quant
from torch_moe_ops.backends.deepgemm import experts as deepgemm_experts
from torch_moe_ops.backends.deepgemm import library
from torch_moe_ops.backends.registry import REGISTRY, Problem
from torch_moe_ops.config import BackendSpec, QuantSpec

CPU_BOUND = 1e-4
GPU_BOUND = 3e-2
STATIC = ("silu", 1.702, 7.0)
FP8_BLOCK = QuantSpec("fp8_block")
CUDA = torch.device("cuda")
BACKEND = REGISTRY.experts["deepgemm"]
# The stand-ins' group alignment: smaller than DeepGEMM's 128 so that small tests pad (the
# smallest the align step makes).
ALIGNMENT = 16


def relative_error(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12)).item()


@pytest.fixture
def sm90(sm90, monkeypatch):
    """The shared ``sm90`` claim, with DeepGEMM importable."""
    monkeypatch.setattr(library, "missing", lambda: None)
    return sm90


def problem(spec=FP8_BLOCK, dtype=torch.bfloat16, hidden=7168, inter=2048, rows=None
            ) -> Problem:
    return Problem(dtype, num_experts=256, num_local_experts=256, hidden_size=hidden,
                   intermediate_size=inter, top_k=8, quant=spec, rows=rows)


FORMAT_REASONS = {
    FP8_BLOCK: None,
    QuantSpec("fp8_block", block_size=(64, 64)): (
        "runs fp8_block128x128+fp8_group only (DeepGEMM's sm90 fp8 recipe), got "
        "fp8_block64x64+fp8_group"),
    QuantSpec("fp8_channel"): ("runs fp8_block128x128+fp8_group only (DeepGEMM's sm90 fp8 "
                               "recipe), got fp8_channel+fp8_token"),
    QuantSpec("mxfp4"): ("runs fp8_block128x128+fp8_group only (DeepGEMM's sm90 fp8 recipe), "
                         "got mxfp4+none"),
    None: ("runs quantized weights only (fp8_block128x128+fp8_group); bf16 layers run on the "
           "other backends"),
}


@pytest.mark.parametrize("spec", list(FORMAT_REASONS), ids=str)
def test_supports_says_which_formats_run(sm90, spec):
    assert BACKEND.why_not(BackendSpec(), problem(spec), CUDA) == FORMAT_REASONS[spec]


WHY_NOT = {  # id: (what differs from an sm90 GPU, bf16, DeepSeek-V3's widths), reason
    "cpu": ({"device": torch.device("cpu")}, "needs a CUDA GPU of sm90, got device cpu"),
    "sm100": ({"sm": (10, 0)}, "needs sm90 (its fp32-scale kernels), got sm100"),
    "fp16": ({"dtype": torch.float16},
             "needs bfloat16 activations (DeepGEMM writes bfloat16), got torch.float16"),
    "I": ({"inter": 1344}, ("needs hidden_size and intermediate_size divisible by 128, got "
                            "7168 and 1344")),
    "decode": ({"rows": 16}, ("runs 0.5 routed rows per expert on average, fewer than 128: its "
                              "layout pads each expert's rows to whole 128-row tiles, and the "
                              "triton kernels are faster there")),
    "T=1024": ({"rows": 1024}, ("runs 32 routed rows per expert on average, fewer than 128: "
                                "its layout pads each expert's rows to whole 128-row tiles, and "
                                "the triton kernels are faster there")),
}


@pytest.mark.parametrize("rows", [None, 4096, 16384])
def test_supports_prefill_and_unknown_token_counts(sm90, rows):
    # 4096 tokens x top-8 over 256 experts: 128 rows an expert; None: sizes not fixed.
    assert BACKEND.why_not(BackendSpec(), problem(rows=rows), CUDA) is None


def test_problem_reads_fixed_token_counts(quant_inputs):
    from torch_moe_ops.backends.problems import problem_of

    args = cpu_inputs(quant_inputs, num_tokens=9).args(*STATIC)
    assert problem_of("experts_quant", args).rows == 9


@pytest.mark.parametrize("case", list(WHY_NOT))
def test_supports_says_why_not(sm90, case):
    changes, reason = WHY_NOT[case]
    assert why_not_after(BACKEND, problem, sm90, changes) == reason


def test_supports_without_deepgemm(sm90, monkeypatch):
    monkeypatch.setattr(library, "missing", lambda: "deep_gemm is not installed (...)")
    assert BACKEND.why_not(BackendSpec(), problem(), CUDA) == "deep_gemm is not installed (...)"


@pytest.mark.parametrize("counts", [[3, 0, 9, 1], [0, 0, 0, 0], [8, 8, 16, 1], [20, 0, 0, 0]])
@pytest.mark.parametrize("skipped", [0, 5])
def test_contiguous_layout(counts, skipped):
    """Each expert's rows start at a multiple of A, in order, after the earlier groups; the
    rows of expert -1 land past every group; the layout's size holds any routing."""
    count_E = torch.tensor(counts, dtype=torch.int32)
    sorted_ids_R = torch.cat([torch.repeat_interleave(torch.arange(4), count_E),
                              torch.full((skipped,), -1)])
    position_R, expert_M = deepgemm_experts.contiguous_layout(sorted_ids_R, count_E, ALIGNMENT)
    num_rows = sorted_ids_R.shape[0]
    assert expert_M.shape == (deepgemm_experts.padded_rows(num_rows, 4, ALIGNMENT),)
    assert expert_M.shape[0] % ALIGNMENT == 0
    assert len(set(position_R.tolist())) == num_rows  # no two rows share a place
    start = 0
    for expert, count in enumerate(counts):
        assert position_R[sum(counts[:expert]):sum(counts[:expert + 1])].tolist() == list(
            range(start, start + count))
        start += -(-count // ALIGNMENT) * ALIGNMENT
    assert torch.equal(expert_M[position_R], sorted_ids_R.to(torch.int32))
    assert (expert_M[start:] == -1).all() and (position_R[num_rows - skipped:] >= start).all()
    assert (expert_M >= 0).sum() == sum(counts)


def test_padded_rows_covers_the_worst_routing():
    # Every row its own expert: each group padded by A - 1.
    assert deepgemm_experts.padded_rows(5, 256, 128) == 5 * 128
    assert deepgemm_experts.padded_rows(32768, 256, 128) == 32768 + 256 * 127
    assert deepgemm_experts.padded_rows(0, 8, 128) == 0


def deepgemm_transposes(a_scale_XG: torch.Tensor) -> bool:
    """Whether DeepGEMM's sm90 GEMMs would copy these fp32 activation scales (1 x 128
    groups, ``[M, G]`` or ``[B, M, G]``) into their layout with a transpose kernel before the
    GEMM: the test that ``get_mn_major_tma_aligned_tensor`` makes to return them as they
    are (DeepGEMM 54e2261, csrc/jit_kernels/impls/smxx_layout.hpp:124; called for them by
    ``transform_sf_into_required_layout``, csrc/apis/layout.hpp:41-42). M-major, each column
    ``align(M, 4)`` apart (``get_tma_aligned_size``: 16 bytes of fp32,
    csrc/utils/math.hpp:23-27), blocks ``align(M, 4) * G`` apart."""
    rows, groups = a_scale_XG.shape[-2:]
    aligned = -(-rows // 4) * 4
    blocks_ok = a_scale_XG.dim() == 2 or a_scale_XG.stride(0) == aligned * groups
    return not (blocks_ok and a_scale_XG.stride(-2) == 1 and a_scale_XG.stride(-1) == aligned)


def _check_operands(a_XK, a_scale_XG, b_GNK, b_scale):
    """What DeepGEMM asserts of its operands on sm90, and that it would take the activation
    scales as they are."""
    assert a_XK.dtype == b_GNK.dtype == quant.FP8_DTYPE
    assert a_XK.stride(-1) == 1 and b_GNK.stride(-1) == 1  # K-major
    assert a_scale_XG.dtype == b_scale.dtype == torch.float32
    groups, cols, depth = b_GNK.shape
    assert a_XK.shape[-1] == depth and depth % ALIGNMENT == 0
    assert a_scale_XG.shape == (*a_XK.shape[:-1], depth // library.SCALE_BLOCK)
    assert b_scale.shape == (groups, cols // library.SCALE_BLOCK, depth // library.SCALE_BLOCK)
    assert not deepgemm_transposes(a_scale_XG), (
        f"DeepGEMM would transpose these activation scales first: {list(a_scale_XG.shape)} "
        f"with strides {a_scale_XG.stride()}")
    # Its TMA reads the scales as one [B * G, align(M, 4)] block: the padding rows exist.
    rows, scale_groups = a_scale_XG.shape[-2:]
    blocks = a_scale_XG.shape[0] if a_scale_XG.dim() == 3 else 1
    read = a_scale_XG.storage_offset() + blocks * scale_groups * (-(-rows // 4) * 4)
    assert a_scale_XG.untyped_storage().nbytes() >= read * a_scale_XG.element_size()


def _dequantized(a_XK, a_scale_XG, b_NK, b_scale_NK):
    a = quant.dequantize_activations(a_XK.reshape(-1, a_XK.shape[-1]),
                                     a_scale_XG.reshape(-1, a_scale_XG.shape[-1]), FP8_BLOCK)
    b = quant.dequantize_weights(b_NK[None], b_scale_NK[None], FP8_BLOCK)[0]
    return a @ b.T


def test_deepgemm_transposes_scales_of_other_layouts():
    """The stand-ins' test of DeepGEMM's layout: what the quantizers wrote before (row-major)
    is transposed; `library.activation_scales` is not, nor DeepEP's ``[E, C, G]``."""
    row_major_MG = torch.empty((8, 3))
    assert deepgemm_transposes(row_major_MG)
    assert deepgemm_transposes(torch.empty((4, 8, 3)))
    assert not deepgemm_transposes(library.activation_scales(8, 3, torch.device("cpu")))
    # M = 5: columns 8 apart (16-byte aligned), not 5.
    assert deepgemm_transposes(torch.empty((3, 5)).T)
    assert not deepgemm_transposes(library.activation_scales(5, 3, torch.device("cpu")))
    assert not deepgemm_transposes(library.activation_scales(1, 1, torch.device("cpu")))
    masked_ECG = library.activation_scales(8, 3, torch.device("cpu"), blocks=4)
    assert masked_ECG.shape == (4, 8, 3) and not deepgemm_transposes(masked_ECG)
    deepep_ECG = torch.empty((4, 3, 128)).transpose(1, 2)  # DeepEP's low-latency scales
    assert not deepgemm_transposes(deepep_ECG)
    # M-major over all E * C rows is not M-major per block.
    assert deepgemm_transposes(torch.empty((3, 32)).T.view(4, 8, 3))


def contiguous_stand_in(a_MK, a_scale_MG, b_GNK, b_scale, group_M):
    """DeepGEMM's contiguous GEMM in fp32: blocks of A rows whose first row has group -1 are
    skipped (NaN), the others computed with that row's group."""
    _check_operands(a_MK, a_scale_MG, b_GNK, b_scale)
    assert group_M.dtype == torch.int32 and group_M.shape == (a_MK.shape[0],)
    assert a_MK.shape[0] % ALIGNMENT == 0
    d_MN = torch.full((a_MK.shape[0], b_GNK.shape[1]), math.nan)
    for start in range(0, a_MK.shape[0], ALIGNMENT):
        rows = slice(start, start + ALIGNMENT)
        group = int(group_M[start])
        if group < 0:
            assert (group_M[rows] == -1).all()
            continue
        assert ((group_M[rows] == group) | (group_M[rows] == -1)).all()
        d_MN[rows] = _dequantized(a_MK[rows], a_scale_MG[rows], b_GNK[group], b_scale[group])
    return d_MN


def masked_stand_in(a_GCK, a_scale_GCX, b_GNK, b_scale, count_G, expected_rows):
    """DeepGEMM's masked GEMM in fp32: rows past each count unwritten (NaN)."""
    _check_operands(a_GCK, a_scale_GCX, b_GNK, b_scale)
    assert count_G.dtype == torch.int32 and 0 < expected_rows
    d_GCN = torch.full((*a_GCK.shape[:2], b_GNK.shape[1]), math.nan)
    for group, count in enumerate(count_G.tolist()):
        d_GCN[group, :count] = _dequantized(a_GCK[group, :count], a_scale_GCX[group, :count],
                                            b_GNK[group], b_scale[group])
    return d_GCN


@pytest.fixture
def gemm_calls(monkeypatch) -> list:
    """DeepGEMM's GEMMs are the stand-ins; the list gets the rows of each call."""
    calls = []
    monkeypatch.setattr(library, "row_alignment", lambda: ALIGNMENT)
    monkeypatch.setattr(library, "grouped_gemm_contiguous",
                        lambda *args: calls.append(args[0].shape[0])
                        or contiguous_stand_in(*args))
    monkeypatch.setattr(library, "grouped_gemm_masked",
                        lambda *args: calls.append(args[0].shape[:2]) or masked_stand_in(*args))
    return calls


def cpu_inputs(quant_inputs, num_tokens=9, bias=False, skip_fraction=0.2):
    """Small fp32 inputs (H=256, I=128: two scale groups a row of the first GEMM, so that
    the scales' layout shows; E=4, K=2) with expert 1 chosen by no slot."""
    inputs = quant_inputs(FP8_BLOCK, num_tokens=num_tokens, hidden_size=256,
                          intermediate_size=128, num_experts=4, top_k=2, bias=bias,
                          skip_fraction=skip_fraction)
    ids_TK = inputs.float_inputs.topk_ids_TK
    ids_TK.masked_fill_(ids_TK == 1, -1)
    return inputs


def op_args(op_name, inputs, static=STATIC) -> tuple:
    """The arguments of ``op_name`` (``..._prequantized``: on rows or blocks quantized by
    the dispatch, fp8 with their scales) with the activation ``static``."""
    if op_name == "experts_quant":
        return inputs.args(*static)
    f = inputs.float_inputs
    prequantized = op_name.endswith("_prequantized")
    if op_name.startswith("experts_rows_quant"):
        x, expert_R, _, _, count_E, _ = torch.ops.moe.dispatch(
            f.hidden_TH, f.topk_weights_TK, f.topk_ids_TK, inputs.w13.shape[0])
        head = (expert_R, count_E)
    else:
        x, count_E = masked_blocks(f.hidden_TH, f.topk_ids_TK, inputs.w13.shape[0])
        head = (count_E,)
    if not prequantized:
        return (x, None, *head, *inputs.weight_args(*static))
    q, scale = quant.quantize_activations(x.reshape(-1, x.shape[-1]), inputs.spec)
    groups = x.shape[-1] // library.SCALE_BLOCK
    return (q.view(x.shape), scale.view(*x.shape[:-1], groups), *head,
            *inputs.weight_args(*static), x.dtype)


def masked_blocks(hidden_TH, topk_ids_TK, num_experts, rows_per_expert=None):
    """``(x_ECH, count_E)``: each expert's tokens at the top of its block, as DeepEP's
    low-latency dispatch leaves them; the rows under the counts are garbage (NaN)."""
    ids = topk_ids_TK.reshape(-1)
    tokens = torch.arange(hidden_TH.shape[0]).repeat_interleave(topk_ids_TK.shape[1])
    count_E = torch.bincount(ids[ids >= 0], minlength=num_experts).to(torch.int32)
    rows = rows_per_expert or max(int(count_E.max()), 1) + 2
    x_ECH = torch.full((num_experts, rows, hidden_TH.shape[1]), math.nan,
                       dtype=hidden_TH.dtype, device=hidden_TH.device)
    for expert in range(num_experts):
        mine = tokens[ids == expert]
        x_ECH[expert, :mine.shape[0]] = hidden_TH[mine]
    return x_ECH, count_E.to(hidden_TH.device)


OP_NAMES = ["experts_quant", "experts_rows_quant", "experts_rows_quant_prequantized",
            "experts_masked_quant", "experts_masked_quant_prequantized"]


def op(namespace: str, op_name: str):
    return getattr(getattr(torch.ops, namespace), op_name.removesuffix("_prequantized"))


def run_both(op_name, inputs, static=STATIC):
    """``(ours, reference)`` of ``op_name`` (see `op_args`); the masked format's rows past
    the counts are compared as zeros, which both give."""
    args = op_args(op_name, inputs, static)
    return op("moe_deepgemm", op_name)(*args), op("moe_reference", op_name)(*args)


INTERPRETER_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(), reason="runs Triton kernels on CPU tensors under the "
    "interpreter; with a GPU the test_gpu_* tests run DeepGEMM itself")


@INTERPRETER_ONLY
@pytest.mark.triton
@pytest.mark.parametrize("op_name", OP_NAMES)
@pytest.mark.parametrize("bias", [False, True])
def test_ops_match_reference_on_cpu(quant_inputs, gemm_calls, poisoned_empty, op_name, bias):
    inputs = cpu_inputs(quant_inputs, bias=bias)
    out, ref = run_both(op_name, inputs)
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    assert not out.isnan().any()
    assert relative_error(out, ref) < CPU_BOUND
    assert len(gemm_calls) == 2


# The other activations, swiglu_oai's clamps biting on O(1) pre-activations.
OTHER_ACTIVATIONS = {"gelu": ("gelu", 1.702, 7.0), "swiglu_oai": ("swiglu_oai", 1.702, 1.0)}


@INTERPRETER_ONLY
@pytest.mark.triton
@pytest.mark.parametrize("op_name", ["experts_quant", "experts_masked_quant"])
@pytest.mark.parametrize("activation", list(OTHER_ACTIVATIONS))
def test_every_activation_on_cpu(quant_inputs, gemm_calls, poisoned_empty, op_name,
                                 activation):
    """The activation applied where it is quantized, on the contiguous and masked layouts
    (the rows past the groups and counts left unwritten: NaN, never read)."""
    out, ref = run_both(op_name, cpu_inputs(quant_inputs, bias=True),
                        OTHER_ACTIVATIONS[activation])
    assert not out.isnan().any()
    assert relative_error(out, ref) < CPU_BOUND


@INTERPRETER_ONLY
@pytest.mark.triton
@pytest.mark.parametrize("op_name", ["experts_quant", "experts_rows_quant"])
def test_zero_tokens_run_no_gemm(quant_inputs, gemm_calls, op_name):
    out, ref = run_both(op_name, cpu_inputs(quant_inputs, num_tokens=0))
    assert out.shape == ref.shape == (0, 256) and out.dtype == ref.dtype
    assert gemm_calls == []


@INTERPRETER_ONLY
@pytest.mark.triton
@pytest.mark.parametrize("op_name", ["experts_quant", "experts_masked_quant"])
def test_all_slots_skipped(quant_inputs, gemm_calls, op_name):
    out, ref = run_both(op_name, cpu_inputs(quant_inputs, skip_fraction=1.0))
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(ref, out)


@INTERPRETER_ONLY
@pytest.mark.triton
def test_masked_fp8_blocks_of_whole_tiles_go_as_they_are(quant_inputs, gemm_calls,
                                                         monkeypatch):
    """Blocks of 128 rows in fp8 with DeepEP's M-major scales reach the first GEMM as they
    are (no copy), in the layout DeepGEMM reads."""
    inputs = cpu_inputs(quant_inputs, num_tokens=5)
    f = inputs.float_inputs
    x_ECH, count_E = masked_blocks(f.hidden_TH, f.topk_ids_TK, inputs.w13.shape[0],
                                   rows_per_expert=library.SCALE_BLOCK)
    q_XH, scale_XG = quant.quantize_activations(x_ECH.reshape(-1, x_ECH.shape[-1]),
                                                inputs.spec)
    num_experts, rows, _ = x_ECH.shape
    scale_ECG = torch.empty((num_experts, scale_XG.shape[1], rows)).transpose(1, 2)
    scale_ECG.copy_(scale_XG.view(num_experts, rows, -1))
    args = (q_XH.view(x_ECH.shape), scale_ECG, count_E, *inputs.weight_args(*STATIC),
            x_ECH.dtype)
    scales_seen = []
    stand_in = library.grouped_gemm_masked
    monkeypatch.setattr(library, "grouped_gemm_masked",
                        lambda *gemm_args: scales_seen.append(gemm_args[1])
                        or stand_in(*gemm_args))
    out = torch.ops.moe_deepgemm.experts_masked_quant(*args)
    ref = torch.ops.moe_reference.experts_masked_quant(*args)
    assert scales_seen[0] is scale_ECG and len(gemm_calls) == 2
    assert relative_error(out, ref) < CPU_BOUND


@INTERPRETER_ONLY
@pytest.mark.triton
@pytest.mark.parametrize("op_name", OP_NAMES)
def test_opcheck_on_cpu(quant_inputs, gemm_calls, op_name):
    args = op_args(op_name, cpu_inputs(quant_inputs, bias=True))
    torch.library.opcheck(op("moe_deepgemm", op_name).default, args,
                          test_utils=FP8_CPU_OPCHECK_UTILS)


@pytest.mark.triton
@pytest.mark.parametrize("spec", [QuantSpec("fp8_block", block_size=(64, 64)),
                                  QuantSpec("fp8_channel")], ids=str)
def test_ops_refuse_formats_deepgemm_does_not_run(quant_inputs, spec):
    inputs = quant_inputs(spec, num_tokens=3, hidden_size=128, intermediate_size=128)
    with pytest.raises(ValueError, match="experts backend 'deepgemm' runs fp8_block128x128"):
        torch.ops.moe_deepgemm.experts_quant(*inputs.args(*STATIC))


@pytest.mark.triton
def test_ops_refuse_widths_of_partial_blocks():
    # H = 192: one whole 128-column block and a partial one, which DeepGEMM's scales lack.
    hidden, inter, num_experts = 192, 128, 4
    fp8 = dict(dtype=quant.FP8_DTYPE)
    with pytest.raises(ValueError, match="needs H and I divisible by 128, got H=192, I=128"):
        deepgemm_experts._check_runs(torch.zeros(num_experts, 2 * inter, hidden, **fp8),
                                     torch.zeros(num_experts, hidden, inter, **fp8), "fp8_block",
                                     "fp8_group", [128, 128])


# GPU: sm90 with DeepGEMM built.

needs_deepgemm = pytest.mark.skipif(
    not torch.cuda.is_available() or BACKEND.why_not(BackendSpec(), problem(), CUDA)
    is not None, reason="needs an sm90 GPU with DeepGEMM built (scripts/build_deepgemm.sh)")


def gpu_inputs(quant_inputs, num_tokens, bias=False):
    """bf16 inputs (H=512, I=256: several scale blocks; E=16, K=4) with expert 3 chosen by
    no slot, made on the CPU (the reference's quantizer) and moved to the GPU with `on_gpu`."""
    inputs = quant_inputs(FP8_BLOCK, num_tokens=num_tokens, hidden_size=512,
                          intermediate_size=256, num_experts=16, top_k=4, bias=bias,
                          skip_fraction=0.1, dtype=torch.bfloat16)
    ids_TK = inputs.float_inputs.topk_ids_TK
    ids_TK.masked_fill_(ids_TK == 3, -1)
    return inputs


def on_gpu(args) -> tuple:
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


# 0 tokens for the formats that have rows per token; the masked format has a block per
# expert whatever the tokens.
GPU_CASES = [(num_tokens, op_name) for num_tokens in (0, 1, 7, 300) for op_name in OP_NAMES
             if num_tokens or not op_name.startswith("experts_masked")]


@pytest.mark.gpu
@needs_deepgemm
@pytest.mark.parametrize("num_tokens, op_name", GPU_CASES)
def test_gpu_ops_match_reference(quant_inputs, op_name, num_tokens):
    args = on_gpu(op_args(op_name, gpu_inputs(quant_inputs, num_tokens, bias=num_tokens == 7)))
    out = op("moe_deepgemm", op_name)(*args)
    ref = op("moe_reference", op_name)(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if num_tokens:
        assert relative_error(out, ref) < GPU_BOUND


@pytest.mark.gpu
@needs_deepgemm
@pytest.mark.parametrize("op_name", OP_NAMES)
def test_gpu_scales_reach_deepgemm_in_its_layout(quant_inputs, monkeypatch, op_name):
    """Every call of DeepGEMM's GEMMs gets activation scales it takes as they are (no
    transpose kernel of its own first)."""
    layouts = []
    for name in ("grouped_gemm_contiguous", "grouped_gemm_masked"):
        gemm = getattr(library, name)
        monkeypatch.setattr(library, name, lambda *args, gemm=gemm: layouts.append(
            (tuple(args[1].shape), args[1].stride(), deepgemm_transposes(args[1])))
            or gemm(*args))
    args = on_gpu(op_args(op_name, gpu_inputs(quant_inputs, 300)))
    out = op("moe_deepgemm", op_name)(*args)
    assert len(layouts) == 2 and not any(transposes for *_, transposes in layouts), layouts
    assert relative_error(out, op("moe_reference", op_name)(*args)) < GPU_BOUND


@pytest.mark.gpu
@needs_deepgemm
@pytest.mark.parametrize("op_name", ["experts_quant", "experts_masked_quant"])
@pytest.mark.parametrize("activation", list(OTHER_ACTIVATIONS))
def test_gpu_every_activation(quant_inputs, op_name, activation):
    args = on_gpu(op_args(op_name, gpu_inputs(quant_inputs, 300, bias=True),
                          OTHER_ACTIVATIONS[activation]))
    out = op("moe_deepgemm", op_name)(*args)
    assert relative_error(out, op("moe_reference", op_name)(*args)) < GPU_BOUND


@pytest.mark.gpu
@needs_deepgemm
def test_gpu_cuda_graph_replays_new_routing(quant_inputs):
    args = list(on_gpu(op_args("experts_quant", gpu_inputs(quant_inputs, 64))))
    fn = torch.ops.moe_deepgemm.experts_quant
    fn(*args)  # compiles DeepGEMM's kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    args[2].copy_(torch.roll(args[2], 1, dims=1))  # new routing, same buffers
    graph.replay()
    ref = torch.ops.moe_reference.experts_quant(*args)
    assert relative_error(out, ref) < GPU_BOUND


@pytest.mark.gpu
@needs_deepgemm
def test_gpu_compiled_module(generator):
    torch.manual_seed(0)
    moe = tmo.MoE(tmo.MoEConfig(hidden_size=512, intermediate_size=256, num_experts=16,
                                top_k=4, quant=FP8_BLOCK), device="cuda", dtype=torch.bfloat16)
    # 1024 tokens x top-4 over 16 experts: 256 rows an expert, enough for `supports`.
    x = torch.randn((1024, 512), generator=generator).to("cuda", torch.bfloat16)
    compiled = torch.compile(moe, backend=tmo.backend(experts="deepgemm"), fullgraph=True)
    with torch.no_grad():
        out, ref = compiled(x), moe(x)
    assert relative_error(out, ref) < GPU_BOUND
    assert "experts: deepgemm" in str(tmo.explain(compiled, x))
