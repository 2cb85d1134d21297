"""A CPU stand-in for the parts of flashinfer-python 0.7.2 the ``flashinfer`` experts
backend calls, written from FlashInfer's documentation and sources, so that the
backend's layout conversion, argument mapping, build check and build opt-in run on
the CPU.

- ``flashinfer.fused_moe.cutlass_fused_moe``: in plain PyTorch, what its CUTLASS
  kernels compute, with the argument checks of its binding
  (``csrc/fused_moe/cutlass_backend/flashinfer_cutlass_fused_moe_binding.cu``). Per
  (token, slot) whose id is in ``[0, E)``: ``h = x @ fc1[e].T + fc1_bias[e]``, the
  first ``I`` columns of ``h`` are the linear (up) half and the last ``I`` the gate
  (``doActivationKernel``: the gate is read at offset ``inter_size``); the
  activation writes the activations' dtype; ``y = a @ fc2[e].T + fc2_bias[e]``;
  ``out[t] = sum of token_final_scales[t, k] * y``. ``Swiglu`` is ``silu(gate) * up``,
  or with ``swiglu_alpha/beta/limit`` its ``SwigluBias``; ``Geglu`` is
  ``gelu(gate) * up`` (erf). ``use_deepseek_fp8_block_scale``: fp8 weights with one
  fp32 scale per 128 x 128 block, both GEMMs' inputs quantized per row and 128
  columns, ``q = fp8(x * (448 / amax))``, scale ``amax / 448``.
  ``use_w4_group_scaling`` with uint8 weights (W4A16): e2m1 values two a byte, as
  ``interleave_moe_weights_for_sm90_mixed_gemm`` left them, e8m0 scales per 32
  columns folded by ``interleave_moe_scales_for_sm90_mixed_gemm`` and viewed as int32 (as
  FlashInfer's W4A16 tests pass them); bf16 activations.
- Those two interleaves. The scales' fold is FlashInfer's documented one (each 64 x 128
  block of scales as 16 rows of 16 bytes: ``[E, N/64, K/128, 16, 16]``, N a multiple of
  64, K of 128). The weights' is a bit shuffle of its CUDA kernel that this stand-in does
  not reproduce: it swaps the two nibbles of each byte instead (with the kernel's
  checks: N a multiple of 16, K of 64), so weights that skip it read back wrong here too.
- ``flashinfer.autotuner.autotune``: a context whose kernel calls go to `PROFILED`
  instead of `CALLS` (FlashInfer's autotuner runs the kernels to time them).
- ``flashinfer.jit.env``: ``FLASHINFER_JIT_DIR`` (the tests point it at a temporary
  folder) and ``get_aot_artifacts`` (none, unless a test adds one).
- ``flashinfer.jit.fused_moe``: ``gen_cutlass_fused_moe_sm90_module`` returns a spec
  whose ``build`` writes the module's library and is recorded in `BUILDS`;
  ``flashinfer.jit.gemm.cutlass.generate_kernels``: a generator of no kernels.

What it cannot tell is whether FlashInfer's kernels behave as documented: the
``gpu`` tests of tests/test_flashinfer_experts.py run the real one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib.machinery
import math
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
MXFP4_GROUP = 32
# The scales' fold: 64 rows by 128 columns of scales a block.
FOLD_ROWS, FOLD_COLS = 64, 128
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_BIAS = 127
# What the tests read: every build asked of the stand-in, every kernel call (those under
# ``autotune(True)`` apart).
BUILDS: list[str] = []
CALLS: list[dict] = []
PROFILED: list[dict] = []
AOT_ARTIFACTS: dict[str, Path] = {}
# Open ``autotune(True)`` contexts, and the options each context was opened with.
TUNING: list[bool] = []
TUNE_OPTIONS: list[dict] = []


@contextlib.contextmanager
def autotune(tune_mode: bool = True, **options):
    TUNE_OPTIONS.append(options)
    TUNING.append(tune_mode)
    try:
        yield
    finally:
        TUNING.pop()


class ActivationType(enum.IntEnum):
    Swiglu = 3
    Geglu = 4


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(f"cutlass_fused_moe (emulated binding check): {message}")


def _round_trip_groups(x_MK: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` through fp8 per row and 128 columns, as FlashInfer's 1 x 128 quantizer."""
    rows, cols = x_MK.shape
    x_MGC = x_MK.float().reshape(rows, cols // BLOCK, BLOCK)
    amax_MG1 = x_MGC.abs().amax(dim=2, keepdim=True)
    factor_MG1 = torch.where(amax_MG1 > 0, FP8_MAX / amax_MG1, 1.0)
    q_MGC = (x_MGC * factor_MG1).to(FP8)
    return (q_MGC.float() / factor_MG1).reshape(rows, cols)


def _dequantize_blocks(w_ENK: torch.Tensor, scale_EBC: torch.Tensor) -> torch.Tensor:
    expanded = scale_EBC.repeat_interleave(BLOCK, dim=1).repeat_interleave(BLOCK, dim=2)
    return w_ENK.float() * expanded


def interleave_moe_weights_for_sm90_mixed_gemm(weight, quant_type="fp4"):
    _check(weight.dim() == 3 and weight.dtype == torch.uint8, "interleave: uint8 [E, n, k/2]")
    _check(quant_type == "fp4", "interleave: the W4A16 path's quant_type")
    _check(weight.shape[1] % 16 == 0 and (2 * weight.shape[2]) % 64 == 0,
           "interleave: n a multiple of 16, k of 64")
    return (weight >> 4) | (weight << 4)


def interleave_moe_scales_for_sm90_mixed_gemm(scales, group_size=32):
    num_experts, rows, groups = scales.shape
    per_block = FOLD_COLS // group_size
    _check(rows % FOLD_ROWS == 0 and groups % per_block == 0,
           "scale fold: rows a multiple of 64, K of 128")
    slices = 16 // per_block
    return (scales.reshape(num_experts, rows // FOLD_ROWS, slices, FOLD_ROWS // slices,
                           groups // per_block, per_block)
            .permute(0, 1, 4, 3, 2, 5).reshape(num_experts, rows // FOLD_ROWS,
                                                 groups // per_block, FOLD_ROWS // slices, 16))


def _unfolded_scales(folded, rows, groups):
    """``[E, rows, groups]`` e8m0 scales from ``interleave_moe_scales_for_sm90_mixed_gemm``'s
    fold."""
    _check(folded.dtype == torch.int32, "W4A16 scales: the folded e8m0 bytes viewed as int32")
    folded = folded.view(torch.uint8)
    num_experts = folded.shape[0]
    per_block = FOLD_COLS // MXFP4_GROUP
    slices = 16 // per_block
    _check(folded.shape == (num_experts, rows // FOLD_ROWS, groups // per_block,
                            FOLD_ROWS // slices, 16), "folded W4A16 scales")
    return (folded.reshape(num_experts, rows // FOLD_ROWS, groups // per_block,
                           FOLD_ROWS // slices, slices, per_block)
            .permute(0, 1, 4, 3, 2, 5).reshape(num_experts, rows, groups))


def _dequantize_w4(interleaved_ENk, folded_scales):
    """fp32 ``[E, N, K]`` of interleaved e2m1 bytes and folded e8m0 scales."""
    packed_ENk = (interleaved_ENk >> 4) | (interleaved_ENk << 4)  # the stand-in's interleave
    num_experts, rows, half_cols = packed_ENk.shape
    magnitudes = torch.tensor(E2M1)
    nibbles = torch.stack([packed_ENk & 0xF, packed_ENk >> 4], dim=-1).long()
    values = magnitudes[nibbles & 7] * torch.where(nibbles >= 8, -1.0, 1.0)
    scales = _unfolded_scales(folded_scales, rows, 2 * half_cols // MXFP4_GROUP)
    factors = torch.exp2(scales.float() - E8M0_BIAS).repeat_interleave(MXFP4_GROUP, dim=2)
    return values.reshape(num_experts, rows, 2 * half_cols) * factors


def _activation(gate, up, activation_type, expert, alpha, beta, limit):
    if activation_type == ActivationType.Geglu:
        return F.gelu(gate) * up
    if alpha is None and beta is None and limit is None:
        return F.silu(gate) * up
    a = 1.0 if alpha is None else alpha[expert].item()
    b = 0.0 if beta is None else beta[expert].item()
    c = math.inf if limit is None else limit[expert].item()
    gate = gate.clamp(max=c)
    return gate * torch.sigmoid(gate * a) * (up.clamp(min=-c, max=c) + b)


def cutlass_fused_moe(input, token_selected_experts, token_final_scales, fc1_expert_weights,
                      fc2_expert_weights, output_dtype, quant_scales, fc1_expert_biases=None,
                      fc2_expert_biases=None, input_sf=None, swiglu_alpha=None,
                      swiglu_beta=None, swiglu_limit=None, tp_size=1, tp_rank=0, ep_size=1,
                      ep_rank=0, cluster_size=1, cluster_rank=0, output=None,
                      enable_alltoall=False, use_deepseek_fp8_block_scale=False,
                      use_w4_group_scaling=False, activation_type=ActivationType.Swiglu,
                      **options):
    (PROFILED if any(TUNING) else CALLS).append({
        "activation_type": activation_type, "num_tokens": input.shape[0],
        "block_scale": use_deepseek_fp8_block_scale, "w4": use_w4_group_scaling,
        "input": input, "ids": token_selected_experts, "scales": token_final_scales,
        "output": output, "options": options})
    x_TH, ids_TK, scales_TK = input, token_selected_experts, token_final_scales
    fc1_EFH, fc2_EHI = fc1_expert_weights, fc2_expert_weights
    _check(ids_TK.dtype == torch.int32 and ids_TK.dim() == 2, "token_selected_experts")
    _check(scales_TK.dtype == torch.float32 and scales_TK.shape == ids_TK.shape,
           "token_final_scales")
    _check(x_TH.dim() == 2 and x_TH.shape[0] == ids_TK.shape[0] and x_TH.is_contiguous(),
           "input")
    weight_dtype = (FP8 if use_deepseek_fp8_block_scale
                    else torch.uint8 if use_w4_group_scaling else x_TH.dtype)
    _check(fc1_EFH.dtype == weight_dtype and fc2_EHI.dtype == weight_dtype, "weight dtype")
    _check(fc1_EFH.is_contiguous() and fc2_EHI.is_contiguous(), "weights contiguous")
    num_experts, hidden, inter = fc2_EHI.shape
    if use_w4_group_scaling:
        _check(x_TH.dtype == torch.bfloat16, "W4A16 takes bf16 activations")
        inter *= 2  # two values a byte
        _check(fc1_EFH.shape == (num_experts, 2 * inter, hidden // 2), "fc1 is [E, 2I, H/2]")
        _check(hidden % FOLD_COLS == 0 and inter % FOLD_COLS == 0,
               "W4A16: H and I multiples of 128")
        _check(len(quant_scales) == 2, "W4A16 takes two scale tensors")
        fc1_EFH = _dequantize_w4(fc1_EFH, quant_scales[0])
        fc2_EHI = _dequantize_w4(fc2_EHI, quant_scales[1])
    _check(fc1_EFH.shape == (num_experts, 2 * inter, hidden), "fc1 is [E, 2I, H]")
    _check(hidden % 8 == 0 and inter % 8 == 0, "TMA alignment")
    biases = (fc1_expert_biases, fc2_expert_biases)
    _check((biases[0] is None) == (biases[1] is None), "both biases or neither")
    if biases[0] is not None:
        _check(all(b.dtype == output_dtype for b in biases), "biases in the output dtype")
        _check(biases[0].shape == (num_experts, 2 * inter)
               and biases[1].shape == (num_experts, hidden), "bias shapes")
    for params in (swiglu_alpha, swiglu_beta, swiglu_limit):
        _check(params is None or (params.dtype == torch.float32
                                  and params.shape == (num_experts,)), "swiglu params")
    _check(output is not None and output.shape == x_TH.shape and output.dtype == output_dtype,
           "output")
    if use_deepseek_fp8_block_scale:
        fc1_scale, fc2_scale = quant_scales
        _check(fc1_scale.shape == (num_experts, 2 * inter // BLOCK, hidden // BLOCK)
               and fc2_scale.shape == (num_experts, hidden // BLOCK, inter // BLOCK)
               and fc1_scale.dtype == fc2_scale.dtype == torch.float32, "block scales")
        w1_EFH = _dequantize_blocks(fc1_EFH, fc1_scale)
        w2_EHI = _dequantize_blocks(fc2_EHI, fc2_scale)
        x_TH = _round_trip_groups(x_TH)
    elif use_w4_group_scaling:
        w1_EFH, w2_EHI, x_TH = fc1_EFH, fc2_EHI, x_TH.float()
    else:
        _check(len(quant_scales) == 0, "no quant scales for bf16")
        w1_EFH, w2_EHI, x_TH = fc1_EFH.float(), fc2_EHI.float(), x_TH.float()
    out_TH = torch.zeros(x_TH.shape, dtype=torch.float32)
    for t in range(x_TH.shape[0]):
        for k in range(ids_TK.shape[1]):
            e = int(ids_TK[t, k])
            if not 0 <= e < num_experts:
                continue
            h_F = w1_EFH[e] @ x_TH[t]
            if biases[0] is not None:
                h_F = h_F + biases[0][e].float()
            a_I = _activation(h_F[inter:], h_F[:inter], activation_type, e, swiglu_alpha,
                              swiglu_beta, swiglu_limit)
            # The activation kernel writes the activations' dtype.
            a_I = a_I.to(input.dtype).float()
            if use_deepseek_fp8_block_scale:
                a_I = _round_trip_groups(a_I[None])[0]
            y_H = w2_EHI[e] @ a_I
            if biases[1] is not None:
                y_H = y_H + biases[1][e].float()
            out_TH[t] += scales_TK[t, k] * y_H
    output.copy_(out_TH.to(output_dtype))
    return [output]


@dataclasses.dataclass
class JitSpec:
    """What ``gen_cutlass_fused_moe_sm90_module`` returns: its build writes the library."""

    name: str
    sources: list = dataclasses.field(default_factory=list)
    extra_include_dirs: list = dataclasses.field(default_factory=list)
    extra_ldflags: list | None = None

    def get_library_path(self) -> Path:
        return jit_env.FLASHINFER_JIT_DIR / self.name / f"{self.name}.so"

    def build(self, verbose: bool = False, need_lock: bool = False) -> None:
        BUILDS.append(self.name)
        self.get_library_path().parent.mkdir(parents=True, exist_ok=True)
        self.get_library_path().write_bytes(b"")

    def load(self, so_path=None):
        return types.SimpleNamespace(path=so_path or self.get_library_path())


def _module(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attributes)
    return module


def gen_cutlass_fused_moe_sm90_module(use_fast_build: bool = False) -> JitSpec:
    return JitSpec("fused_moe_90")


def get_aot_artifacts(name: str) -> tuple:
    path = AOT_ARTIFACTS.get(name)
    return () if path is None else (types.SimpleNamespace(path=path),)


jit_env = _module("flashinfer.jit.env", FLASHINFER_JIT_DIR=Path("/nonexistent"),
                  FLASHINFER_GEN_SRC_DIR=Path("/nonexistent"),
                  get_aot_artifacts=get_aot_artifacts)
# FlashInfer's kernel generator, generating no kernels.
generate_kernels = _module("flashinfer.jit.gemm.cutlass.generate_kernels",
                           generate_gemm_operations=lambda output_dir, architectures: None,
                           generate_sm90_operations=lambda enabled: [],
                           generate_sm80_operations=lambda enabled: [])
MODULES = {
    "flashinfer": _module("flashinfer"),
    "flashinfer.fused_moe": _module(
        "flashinfer.fused_moe", ActivationType=ActivationType,
        cutlass_fused_moe=cutlass_fused_moe,
        interleave_moe_weights_for_sm90_mixed_gemm=interleave_moe_weights_for_sm90_mixed_gemm,
        interleave_moe_scales_for_sm90_mixed_gemm=interleave_moe_scales_for_sm90_mixed_gemm),
    # Where cutlass_fused_moe finds its sm90 spec.
    "flashinfer.fused_moe.core": _module(
        "flashinfer.fused_moe.core",
        gen_cutlass_fused_moe_sm90_module=gen_cutlass_fused_moe_sm90_module),
    "flashinfer.autotuner": _module("flashinfer.autotuner", autotune=autotune),
    "flashinfer.jit": _module("flashinfer.jit", env=jit_env),
    "flashinfer.jit.env": jit_env,
    "flashinfer.jit.gemm": _module("flashinfer.jit.gemm"),
    "flashinfer.jit.gemm.cutlass": _module("flashinfer.jit.gemm.cutlass",
                                           generate_kernels=generate_kernels),
    "flashinfer.jit.gemm.cutlass.generate_kernels": generate_kernels,
    "flashinfer.jit.fused_moe": _module(
        "flashinfer.jit.fused_moe",
        gen_cutlass_fused_moe_sm90_module=gen_cutlass_fused_moe_sm90_module,
        _should_enable_sm90_moe_prebuilt_d_descriptor=lambda: False),
}
MODULES["flashinfer"].fused_moe = MODULES["flashinfer.fused_moe"]
MODULES["flashinfer.fused_moe"].core = MODULES["flashinfer.fused_moe.core"]
MODULES["flashinfer"].jit = MODULES["flashinfer.jit"]
MODULES["flashinfer"].autotuner = MODULES["flashinfer.autotuner"]
MODULES["flashinfer.jit"].fused_moe = MODULES["flashinfer.jit.fused_moe"]


def install(jit_dir: Path) -> None:
    """Make ``import flashinfer`` import this stand-in (for the rest of the process:
    tests use `monkeypatch` to undo it), its JIT cache in ``jit_dir``, nothing built."""
    jit_env.FLASHINFER_JIT_DIR = Path(jit_dir)
    jit_env.FLASHINFER_GEN_SRC_DIR = Path(jit_dir) / "generated"
    BUILDS.clear()
    CALLS.clear()
    PROFILED.clear()
    TUNE_OPTIONS.clear()
    AOT_ARTIFACTS.clear()
    sys.modules.update(MODULES)
